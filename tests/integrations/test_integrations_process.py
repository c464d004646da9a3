"""Integration probes across processes: ctxreplay alone imports neither
framework and lists their probes inactive; the diffusers probe works whether
ctxreplay or diffusers is imported first; a capture saved here is guarded
and dispatched in a fresh process.  Each child process checks its outputs
against its own eager reruns and prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.models,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _child(source: str, *argv: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(source), *argv],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


_ALONE = """
    import json, sys
    import ctxreplay
    from ctxreplay.cli import main
    from ctxreplay.probes import available_probes, default_probes
    main(["probes"])
    infos = available_probes()
    print(json.dumps({
        "imported": sorted(m for m in ("diffusers", "transformers") if m in sys.modules),
        "default": list(default_probes()),
        "snapshot": list(ctxreplay.snapshot().names),
        "builtin_defaults": sorted(n for n, i in infos.items()
                                   if i.default and i.origin == "builtin"),
        "inactive": {n: i.inactive for n, i in infos.items() if i.inactive},
    }))
"""


def test_without_the_frameworks_the_integrations_are_listed_inactive() -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_ALONE)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *listing, last = proc.stdout.strip().splitlines()
    result = json.loads(last)
    assert result["imported"] == []  # ctxreplay imports neither framework
    assert result["inactive"] == {"diffusers_attention": "diffusers is not imported",
                                  "transformers_attention": "transformers is not imported"}
    # the default set is the torch probes alone, as before the integrations
    assert not {"diffusers_attention", "transformers_attention"} & set(result["default"])
    assert result["default"] == [n for n in result["builtin_defaults"]
                                 if n not in result["inactive"]]
    assert result["snapshot"] == result["default"]
    text = "\n".join(listing)
    assert "diffusers_attention  [default, builtin, inactive]" in text
    assert "inactive: diffusers is not imported" in text
    assert "transformers_attention [default, builtin, inactive]" in text
    assert "inactive: transformers is not imported" in text


# a small attention block that dispatches through diffusers, captured under
# _native_math and checked against eager reruns; argv[1]: which import first
_ORDER = """
    import json, sys
    if sys.argv[1] == "ctxreplay_first":
        import ctxreplay
        import torch
        from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
    else:
        import torch
        from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
        import ctxreplay

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 33, 3, 2, 8).unbind(2)
            return dispatch_attention_fn(q, k, v).flatten(2)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Attention() for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 33, 16)
    eager = {}
    for name in ("native", "_native_math"):
        with attention_backend(name):
            eager[name] = model(x)
    with ctxreplay.capture_with(model, targets="repeated") as session, \\
            attention_backend("_native_math"):
        model(x)
    report = session.finalize()
    handle = ctxreplay.install(model, report)
    with attention_backend("_native_math"):
        math = model(x)
    hits = handle.stats().total_hits
    native = model(x)
    print(json.dumps({
        "ok": report.ok,
        "states": sorted({c.snapshot.describe().get("diffusers_attention", "absent")
                          for c in report.captures}),
        "hits": hits, "misses": handle.stats().reasons,
        "math_equal": bool(torch.equal(math, eager["_native_math"])),
        "native_equal": bool(torch.equal(native, eager["native"])),
        "backends_differ": not torch.equal(eager["native"], eager["_native_math"]),
    }))
"""


@pytest.mark.parametrize("order", ["ctxreplay_first", "diffusers_first"])
def test_the_diffusers_probe_works_whatever_the_import_order(order: str) -> None:
    pytest.importorskip("diffusers")
    result = _child(_ORDER, order)
    assert result["backends_differ"]
    assert result["ok"] and result["states"] == ["_native_math"]
    assert result["hits"] == 2 and result["math_equal"]
    assert result["misses"] == {"context": 2} and result["native_equal"]


_WAN = """
    def wan():
        import diffusers, torch
        torch.manual_seed(0)
        return diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()

    def inputs():
        import torch
        g = torch.Generator().manual_seed(1)
        return {"hidden_states": torch.rand(1, 4, 2, 8, 8, generator=g),
                "timestep": torch.tensor([3]),
                "encoder_hidden_states": torch.rand(1, 4, 16, generator=g)}
"""

_FRESH = _WAN + """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    from diffusers.models.attention_dispatch import attention_backend
    model, src = wan(), ctxreplay.load(sys.argv[1])

    def run(name):
        with torch.no_grad(), attention_backend(name):
            return model(**inputs()).sample

    eager = {name: run(name) for name in ("native", "_native_math", "flex")}
    result = {"differ": {n: not torch.equal(eager[n], eager["native"]) for n in eager}}
    handle = ctxreplay.install(model, src)
    for name in ("_native_math", "flex", "native"):
        before = handle.stats().total_hits
        out = run(name)
        with attention_backend(name):
            found = [d.text for d in src.check()]
        result[name] = {"hits": handle.stats().total_hits - before,
                        "equal": bool(torch.equal(out, eager[name])), "check": found}
    result["reasons"] = handle.stats().reasons
    print(json.dumps(result))
"""

_SAVE = _WAN + """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    model = wan()
    with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session, \\
            torch.no_grad():
        model(**inputs())
    report = session.finalize()
    assert report.ok and report.save_all(sys.argv[1]).ok
    print('{"saved": true}')
"""


def test_a_saved_default_capture_is_guarded_in_a_fresh_process(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    assert _child(_SAVE, str(tmp_path))["saved"]
    result = _child(_FRESH, str(tmp_path))
    assert result["differ"] == {"native": False, "_native_math": True, "flex": True}
    for name in ("_native_math", "flex"):
        assert result[name]["hits"] == 0 and result[name]["equal"], name
        assert result[name]["check"] and all(
            t.startswith(f"diffusers_attention: needs native, now {name}")
            for t in result[name]["check"]), result[name]
    assert result["native"] == {"hits": 3, "equal": True, "check": []}
    assert result["reasons"] == {"context": 6}


_PROCESSORS = _WAN + """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    model = wan()

    def set_processors(name):
        for m in model.modules():
            proc = getattr(m, "processor", None)
            if proc is not None and hasattr(proc, "_attention_backend"):
                proc._attention_backend = name

    def run():
        with torch.no_grad():
            return model(**inputs()).sample

    if sys.argv[2] == "save":
        set_processors("_native_math")
        with ctxreplay.capture_with(model, targets="repeated", verify="execute") as session:
            run()
        report = session.finalize()
        assert report.ok and report.save_all(sys.argv[1]).ok
        print('{"saved": true}')
    else:
        eager = {"native": run()}
        set_processors("_native_math")
        eager["_native_math"] = run()
        set_processors(None)
        handle = ctxreplay.install(model, ctxreplay.load(sys.argv[1]))
        result = {"differ": not torch.equal(eager["native"], eager["_native_math"])}
        for name in ("native", "_native_math"):
            set_processors(None if name == "native" else name)
            before = handle.stats().total_hits
            out = run()
            result[name] = {"hits": handle.stats().total_hits - before,
                            "equal": bool(torch.equal(out, eager[name]))}
        result["reasons"] = handle.stats().reasons
        print(json.dumps(result))
"""


def test_a_capture_under_a_processor_backend_runs_it_in_a_fresh_process(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    assert _child(_PROCESSORS, str(tmp_path), "save")["saved"]
    result = _child(_PROCESSORS, str(tmp_path), "load")
    assert result["differ"]  # else a graph of the wrong kernel could pass
    assert result["native"] == {"hits": 0, "equal": True}
    assert result["_native_math"] == {"hits": 3, "equal": True}
    assert result["reasons"] == {"context": 3}


#: the live job of a diffusers user: CPU bfloat16 autocast and inference mode
#: under the _native_math backend, checked by value, finalized outside that
#: backend; each block's live outputs are kept by the script's own hooks
_MATH_BF16_SAVE = _WAN + """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    from diffusers.models.attention_dispatch import attention_backend
    model = wan()
    live = []
    for b in model.blocks:
        b.register_forward_hook(lambda m, a, o: live.append(o.float().clone()))
    with ctxreplay.capture_with(model, targets="repeated", verify="values") as session:
        with attention_backend("_native_math"), torch.autocast("cpu", dtype=torch.bfloat16), \\
                torch.inference_mode():
            model(**inputs())
    report = session.finalize()
    torch.save(live, sys.argv[1] + "/live.pt")
    report.save_all(sys.argv[1])
    print(json.dumps({"ok": report.ok, "captures": [
        (c.scope, c.variant, c.fidelity.to_json()) for c in report.captures]}))
"""

_MATH_BF16_LOAD = _WAN + """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, ctxreplay
    from diffusers.models.attention_dispatch import attention_backend
    model = wan()
    outs = []
    for b in model.blocks:
        b.register_forward_hook(lambda m, a, o: outs.append(o.float().clone()))

    def run():
        outs.clear()
        with attention_backend("_native_math"), torch.autocast("cpu", dtype=torch.bfloat16), \\
                torch.inference_mode():
            model(**inputs())
        return list(outs)

    eager = run()
    with ctxreplay.install(model, ctxreplay.load(sys.argv[1])) as handle:
        got = run()
        hits = handle.stats().total_hits
    with attention_backend("native"), torch.autocast("cpu", dtype=torch.bfloat16), \\
            torch.inference_mode():
        model(**inputs())
    native = list(outs[-3:])
    live = torch.load(sys.argv[1] + "/live.pt")
    print(json.dumps({
        "hits": hits,
        "eager": [bool(torch.equal(a, b)) for a, b in zip(got, eager, strict=True)],
        "live": [bool(torch.equal(a, b)) for a, b in zip(got, live, strict=True)],
        "native_differs": any(not torch.equal(a, b) for a, b in zip(native, eager))}))
"""


def test_a_math_backend_bfloat16_capture_dispatches_eagers_values_in_a_fresh_process(
        tmp_path: Path) -> None:
    """The saved math-lowered graph under bfloat16 autocast: the lowering used
    to hand the math op float32 inputs (a norm's output, which autocast keeps
    in float32) with autocast still on inside it, so the graph computed up to
    0.016 away from torch's math kernel -- after load and in-process alike,
    and its check by value passed or failed by a hair.  Saved twice, under
    two hash seeds: the verdict is the same both times."""
    pytest.importorskip("diffusers")
    verdicts = []
    for seed in ("1", "2"):
        where = tmp_path / seed
        where.mkdir()
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_MATH_BF16_SAVE),
                               str(where)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert proc.returncode == 0, proc.stderr[-3000:]
        verdicts.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert verdicts[0] == verdicts[1]
    assert verdicts[0]["ok"], verdicts[0]
    result = _child(_MATH_BF16_LOAD, str(tmp_path / "1"))
    assert result["native_differs"]  # else another kernel's graph would pass
    assert result["hits"] == 3
    assert result["eager"] == [True] * 3 and result["live"] == [True] * 3, result
