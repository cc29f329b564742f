from hpipe.core import cpuinfo


def test_the_cpu_is_named_and_its_vendor_known_on_linux():
    # every CI and developer machine of this project is x86-64 Linux
    assert cpuinfo.model_name()
    assert cpuinfo.vendor() in ("GenuineIntel", "AuthenticAMD")


def test_an_unreadable_cpuinfo_falls_back_to_platform(monkeypatch):
    cpuinfo._field.cache_clear()
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    try:
        assert cpuinfo.model_name()  # platform.processor() or platform.machine()
        assert cpuinfo.vendor() in ("GenuineIntel", "")
    finally:
        monkeypatch.undo()
        cpuinfo._field.cache_clear()
