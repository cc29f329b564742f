"""The entry points: the ``hpipe`` command, the daemon put together, the demo, the bench, reports
and charts. The only code that knows every package."""
