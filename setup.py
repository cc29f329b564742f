"""Builds hpipe with its gRPC code generated from proto/stage.proto (metadata lives in setup.cfg)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithWireCode(build_py):
    """Also generate runtime/wire/proto_gen into the build: an installed hpipe has no proto to generate from."""

    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("protogen", HERE / "runtime" / "wire" / "protogen.py")
        protogen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protogen)
        protogen.generate(HERE / "proto" / "stage.proto", Path(self.build_lib) / "runtime" / "wire" / "proto_gen")


setup(cmdclass={"build_py": BuildPyWithWireCode})
