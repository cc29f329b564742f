"""What daemons and coordinators share: the generated messages, framing, transport and channels."""
