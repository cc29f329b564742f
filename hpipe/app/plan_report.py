"""Human-readable plan summary (stderr): stages, memory, predicted times, hpipe vs baselines."""

from __future__ import annotations

import math

from hpipe.core.plan import Plan


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def plan_table(plan: Plan) -> str:
    sp = plan.chosen
    lines = [f"plan: {plan.model_name} {plan.dtype}, {plan.seq_len} tokens x batch {plan.batch} "
             f"(max length {plan.max_len}), strategy {sp.name}",
             f"{'stage':>5} {'daemon':<14} {'units':<12} {'memory GiB':>11} {'of GiB':>7} {'compute s':>10}"]
    for i, st in enumerate(sp.stages):
        lines.append(f"{i:>5} {st.daemon:<14} {f'[{st.units.start}, {st.units.end})':<12} "
                     f"{_gib(st.memory_bytes):>11} {_gib(st.memory_limit):>7} {st.compute_s:>10.3f}")
    lines.append(f"slices ({len(sp.slices)}): {list(sp.slices)[:24]}{' ...' if len(sp.slices) > 24 else ''}; "
                 f"micro-batches: {sp.micro_batches}")
    lines.append("")
    lines.append(f"{'strategy':<10} {'predicted s':>12} {'tokens/s':>10} {'hpipe / it':>11}")
    hp = plan.strategies["hpipe"].predicted_s
    for name in ("hpipe", "throughput", "base", "gpipe", "gp_b", "terapipe"):
        s = plan.strategies.get(name)
        if s is None:
            if name != "throughput":
                lines.append(f"{name:<10} {'infeasible':>12}")
            continue
        tps = plan.batch * plan.seq_len / s.predicted_s if s.predicted_s > 0 else math.inf
        lines.append(f"{name:<10} {s.predicted_s:>12.3f} {tps:>10.0f} {hp / s.predicted_s:>11.2f}")
    lines.append(f"{'ideal':<10} {plan.ideal_s:>12.3f}   (total work / summed device speed)")
    lines.extend(_answer_lines(plan))
    lines.extend(_serving_lines(plan.meta.get("serving")))
    lines.append(f"planned in {plan.meta.get('planning_s', 0):.2f} s")
    return "\n".join(lines)


def _answer_lines(plan: Plan) -> list[str]:
    """Where the plan was made for an answer (``hpipe plan --output-len``): each strategy's prefill,
    one answer token through its chain, and the two together, the sum hpipe's plan is chosen by."""
    answer = plan.meta.get("answer")
    if not answer:
        return []
    n = answer["output_len"]
    lines = ["", f"with a {n}-token answer, decoded one token at a time after the prefill:",
             f"{'strategy':<10} {'prefill s':>10} {'token ms':>9} {'answer s':>9} {'total s':>8}"]
    for name, token_s in answer["token_s"].items():
        prefill = plan.strategies[name].predicted_s
        lines.append(f"{name:<10} {prefill:>10.3f} {token_s * 1e3:>9.2f} {n * token_s:>9.3f} "
                     f"{prefill + n * token_s:>8.3f}")
    return lines


def _serving_lines(serving: dict | None) -> list[str]:
    """Each daemon's predicted seconds per request of the serving mix, under hpipe's split and the
    throughput one: the busiest bounds requests per second when many are served."""
    if not serving:
        return []
    mix, loads = serving["mix"], serving["daemon_request_s"]
    names = list(loads["hpipe"])
    lines = ["", f"serving {mix['prompt']}-token prompts, {mix['output']}-token answers "
                 f"({mix['decode_batch']} decode tokens per micro-batch): seconds per request on each daemon",
             f"{'split':<10} " + " ".join(f"{n:>10}" for n in names) + f" {'busiest':>10} {'req/s':>7}"]
    for split, per in loads.items():
        busiest = max(per.values())
        lines.append(f"{split:<10} " + " ".join(f"{per.get(n, 0.0):>10.3f}" for n in names)
                     + f" {busiest:>10.3f} {1 / busiest:>7.2f}")
    return lines
