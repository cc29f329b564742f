"""What the commands read and check before any work: text files, plans, profiles, output paths,
devices, and the plan and cluster a ``--plan`` or ``--model`` command runs on."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

from hpipe.core.errors import InputError


def read_text(path: str, what: str) -> str:
    """The text of ``path``, or a one-line error (missing, unreadable, a folder, not UTF-8 text)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise InputError(f"{what} {path} is not UTF-8 text") from None


def write_or_print(text: str, path: str | None) -> None:
    if path and path != "-":
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    else:
        print(text)


def check_output(path: str | None, what: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, or in a missing one."""
    if not path or path == "-":
        return
    out = Path(path)
    if out.is_dir():
        raise InputError(f"-o {out} is a folder; name the {what} file to write")
    if not out.parent.is_dir():
        raise InputError(f"cannot write {out}: the folder {out.parent} does not exist")


def check_device(device: str) -> None:
    """Refuse a device this machine cannot compute on, before anything loads."""
    from hpipe.core.cluster import DEVICE

    if not DEVICE.match(device):
        raise InputError(f"--device {device!r} is not cpu or cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def load_profile(path: str):
    from hpipe.core.profile import Profile

    return Profile.from_json(read_text(path, "profile"), str(path))


def load_plan(path: str):
    from hpipe.core.plan import Plan

    return Plan.from_json(read_text(path, "plan"), str(path))


def cluster_for(plan, cluster_file: str | None):
    """The cluster file if given, else one made of the plan's stage addresses (no token, no TLS);
    this process coordinates it on one CPU thread."""
    from hpipe.core.cluster import ClusterSpec, DaemonSpec
    from runtime.coordinator.pipeline import coordinate_on_one_thread

    coordinate_on_one_thread()

    if cluster_file:
        return ClusterSpec.load(cluster_file)
    seen = {}
    for sp in plan.strategies.values():
        for st in sp.stages:
            seen.setdefault(st.daemon, st.address)
    return ClusterSpec("from-plan", tuple(DaemonSpec.at(n, a) for n, a in seen.items()))


@contextmanager
def planned(args: argparse.Namespace, serving: bool):
    """``(plan, cluster, source)``: from ``--plan``, or made on the spot for ``--model``
    (:mod:`hpipe.app.one_box`, which stops the daemons it started on leaving)."""
    from hpipe.model.weights.sources import resolve_model

    if args.plan:
        if args.max_len:
            raise InputError("--max-len goes with --model (a plan has its own)")
        if args.quantize:
            raise InputError("--quantize goes with --model (a plan names its model: profile with --quantize)")
        the_plan = load_plan(args.plan)
        yield the_plan, cluster_for(the_plan, args.cluster), resolve_model(the_plan.model_name)
        return
    from hpipe.app.one_box import planned as on_the_spot
    from hpipe.model.weights.sources import quantized_model

    answer = {"output_len": args.max_new_tokens} if getattr(args, "max_new_tokens", None) else {}
    with on_the_spot(quantized_model(args.model, args.quantize), args.cluster, max_len=args.max_len, seq_len=None,
                     serving=serving, dequantize=args.dequantize, **answer) as got:
        yield got


def templates(args: argparse.Namespace):
    """The long methods' prompts: the defaults, or those given (``@FILE`` read from a file)."""
    from hpipe.app.long_docs import Templates

    given = {}
    for kind in ("map", "reduce", "refine"):
        value = getattr(args, f"{kind}_prompt")
        if value and value.startswith("@"):
            try:
                value = Path(value[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"--{kind}-prompt: cannot read {value[1:]}: {e}") from None
        if value:
            given[kind] = value
    return Templates(**given)
