"""A fuzz of the native door (``mx.nd.mx_roi_<Op>``, ``mx.sym.mx_roi_<Op>`` + bind) against
the Custom door (``mx.nd.Custom`` / ``mx.sym.Custom`` on ``MX_ROI_BACKEND=native``, its
checked path: ``MX_ROI_LIBRARY_CALLS=0``).

``python -m mx_roi.ext.fuzz --cases N --seed S`` runs N seeded cases, each one bad (or rare)
input -- roi values, batch indices, shapes, dtypes, parameter spellings -- through both doors
as an inference call, a training step (record -> forward -> backward -> read, no wait) or a
bound symbol's training step, then a good call through the native door.  Every op that has
both a registered Custom op and an ``mx_roi_<Op>`` in the library is fuzzed (its
``selftest_cases`` are the base parameters, :func:`mx_roi.opcheck.problem` the inputs).
Cases run in child processes, a batch per child; one that kills its child is an abort and
the next child starts after it.  Each case is classified:

- ``abort``: the process died;
- ``wrong-silent``: the native door ran without error but its output or gradients differ
  from the Custom door's, bit for bit (NaN where the Custom door gives numbers included),
  or it ran where the Custom door refuses the input;
- ``broken-after``: the good call after the case failed or differs from the Custom door's;
- ``unclear``: an error whose library lines are not exactly one line naming the op
  (``'<Op>: '``) equal to the Custom door's message, or an error where the Custom door runs;
- ``ok``.

Prints one JSON line of counts (and the failing cases with ``--show``); exit status 1
unless every class but ``ok`` is 0.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

CLASSES = ("ok", "abort", "wrong-silent", "broken-after", "unclear")
DOORS = ("nd-forward", "nd-train", "sym-train")

#: rare spellings of an integer-valued parameter (size or count) and of a real one; the
#: parameter-parser parity test (tests/test_ext_fuzz.py) reads them too
INT_SPELLINGS = ("-(7)", " 7 ", "7.0", "1e3", "0x10", "0o7", "0b11", "+7", "(+7)", "- 7",
                 "--7", "-(-7)", "(7)", "((7))", "((7),)", "(7,)", "(7, 7, 7)", "[7,7]",
                 "[[7,7]]", "(7, -(2))", "2", "1_0", "1__0", "_7", "7_", "07", "00", "0",
                 "-0", "'7'", '"7"', "'7.0'", "' 7 '", "('7', 7)", "b'7'", "7j", "1+2j",
                 "True", "False", "None", "true", "yes", "", " ", "()", "[]", "(,)", "nan",
                 "inf", "-inf", "1e400", "1.5", "7.", ".7e1", "7e0", "2**3",
                 str(2 ** 31 - 2), str(2 ** 31 - 1), str(2 ** 31), str(2 ** 53 + 1),
                 f"({2 ** 53 + 1}, 1)", str(2 ** 63 - 1), str(2 ** 63), str(2 ** 64),
                 str(2 ** 70), f"-{2 ** 70}", f"(2, {2 ** 64})", "0x" + "f" * 20,
                 "1e18", "1e19", "1e30", "-1e30", "9.3e18", "\u0667", "(\u0667, 2)",
                 "'\u0667'", "\u0663\u0662", "\uff17", "7\u00a0", "\u20077", "\u2028 7",
                 "7\x85", "\x1c7", "\t7\n", "7 # c", "(7 ,\t7)", "( 7 , 7 , )",
                 "{7}", "{7: 7}", "7;", "0X1F", "0B1", "0O7", "0x", "0x_1", "0x1_f", "0_7",
                 "1e1_0", "1_0.5", "(1e1, 2)", "(2.5, 2)", "(2, 2.0)", "(0.5e1, 2)",
                 "(1, 2, 3)", "([7], 7)", "(7, (7,))", "(7, None)", "(True, 2)", "-1",
                 "(-1, 2)", "(2, 0)", "1e-400", "-1e-400")
REAL_SPELLINGS = ("0.5", " 0.5 ", "5e-1", "1/2", "0x1p-1", "0.5f", "nan", "NaN", "-nan",
                  "inf", "Infinity", "-inf", "1e-400", "1e-320", "1e-30", "1e30", "1e308",
                  "1e309", "-0.5", "0", "-0", "1_0.5", "1__0", ".5", "5.", ".", "e5", "+.5e+0",
                  "\u0660.\u0665", "\uff10.\uff15", "0.5\u00a0", "'0.5'", "(0.5)", "(0.5,)",
                  "True", "", " ", "1" * 400, "0." + "0" * 400 + "1", str(2 ** 1100),
                  "0.0625", "1e-5", "3.4028234663852886e+38")
BOOL_SPELLINGS = ("True", "true", "TRUE", " yes ", "on", "1", "0", "off", "No", "2", "-1",
                  "1.0", "t", "", " ", "maybe", "\u0661", "True\u00a0", "none")


def ext_ops():
    """The registered ops with an ``mx_roi_<Op>`` in the loaded library (name -> RoIOp)."""
    import mxnet as mx

    from ..registry import REGISTERED
    return {n: op for n, op in sorted(REGISTERED.items()) if hasattr(mx.nd, "mx_roi_" + n)}


# ---- a case ---------------------------------------------------------------------------------
def _spellings(param_cls, name):
    from ..params import parse_bool, parse_float
    import dataclasses
    f = {f.name: f for f in dataclasses.fields(param_cls)}[name]
    parser = f.metadata["parser"]
    if parser is parse_bool:
        return BOOL_SPELLINGS
    if parser is parse_float:
        return REAL_SPELLINGS
    return INT_SPELLINGS


DEFECTS = ("param", "param", "param", "nan", "inf", "huge", "negative", "batch>=N",
           "batch-frac", "batch-neg0", "batch-neg", "far", "reversed", "scale-tiny",
           "scale-huge", "R=0", "zero-dim", "rank", "columns", "dtype-mismatch", "dtype-int",
           "f16-extreme", "offset-view", "pooled-huge", "good")


def _defects():
    """DEFECTS, less those named in $MX_ROI_FUZZ_SKIP, or only those in $MX_ROI_FUZZ_ONLY
    (comma-separated; the tests' slices)."""
    only = [d for d in os.environ.get("MX_ROI_FUZZ_ONLY", "").split(",") if d]
    skip = set(os.environ.get("MX_ROI_FUZZ_SKIP", "").split(","))
    return tuple(d for d in DEFECTS if (not only or d in only) and d not in skip)


def make_case(seed, index, ops):
    """Case ``index`` of seed ``seed``: a dict of plain values (op, params, door, defect,
    arrays), the same in the parent and every child."""
    from .. import opcheck
    rng = np.random.default_rng([seed, index])
    name = sorted(ops)[rng.integers(len(ops))]
    op_cls = ops[name]
    params = dict(op_cls.selftest_cases[rng.integers(len(op_cls.selftest_cases))])
    dtype = [np.float32, np.float64, np.float16][rng.integers(3)]
    door = DOORS[rng.integers(len(DOORS))]
    defects = _defects()
    defect = defects[rng.integers(len(defects))]
    op = opcheck.make_op(name, params)
    data, rois, grad, extra = opcheck.problem(op, dtype, seed=int(rng.integers(1 << 30)))
    kw = {k: str(v) for k, v in params.items()}
    r = rng.integers(len(rois))
    col = int(rng.integers(1, rois.shape[1]))
    N = data.shape[0]
    rois = rois.astype(np.float64)
    if defect == "param":
        field = sorted(op_cls.param_cls.field_names())[rng.integers(
            len(op_cls.param_cls.field_names()))]
        spellings = _spellings(op_cls.param_cls, field)
        kw[field] = spellings[rng.integers(len(spellings))]
    elif defect in ("nan", "inf", "huge", "negative", "far"):
        value = {"nan": np.nan, "inf": [np.inf, -np.inf][rng.integers(2)],
                 "huge": [1e30, -1e30, 3.0e38, 3.4e38, 65504.0, 1e6][rng.integers(6)],
                 "negative": -float(rng.integers(1, 100)),
                 "far": [1e5, -1e5, 5e4][rng.integers(3)]}[defect]
        rois[r, col if defect != "nan" else rng.integers(0, rois.shape[1])] = value
        if defect == "far":
            rois[r, 1:] = rois[r, 1:] + value
    elif defect == "batch>=N":
        rois[r, 0] = [N, N + 5, 1e10, np.float64(N) - 1e-3 + 1][rng.integers(4)]
    elif defect == "batch-frac":
        rois[r, 0] = [0.5, N - 0.5, N - 1 + 0.999, -0.5, -0.999][rng.integers(5)]
    elif defect == "batch-neg0":
        rois[r, 0] = -0.0
    elif defect == "batch-neg":
        rois[r, 0] = [-1, -2, -1e10, -np.inf][rng.integers(4)]
    elif defect == "reversed":
        rois[r, 1], rois[r, 3] = rois[r, 3], rois[r, 1]
    elif defect == "scale-tiny":
        kw["spatial_scale"] = ["1e-30", "1e-38", "5e-324", "1e-45"][rng.integers(4)]
    elif defect == "scale-huge":
        kw["spatial_scale"] = ["1e30", "3e38", "1e300", "65504"][rng.integers(4)]
    elif defect == "R=0":
        rois = rois[:0]
    elif defect == "zero-dim":
        shape = list(data.shape)
        shape[rng.integers(4)] = 0
        data = np.zeros(shape, data.dtype)
    elif defect == "rank":
        which = rng.integers(4)
        if which == 0:
            rois = rois[0]
        elif which == 1:
            rois = rois[None]
        elif which == 2:
            data = data[0]
        else:
            data = data[None]
    elif defect == "columns":
        k = rois.shape[1]
        rois = rois[:, :k - 1] if rng.integers(2) else np.concatenate([rois, rois[:, :1]], 1)
    elif defect == "f16-extreme":
        dtype = np.float16
        data = np.full(data.shape, [65504.0, -65504.0, 6e-8, 0.0][rng.integers(4)])
        rois[r, col] = [65504.0, 65520.0, -65504.0, 6e-8][rng.integers(4)]
    elif defect == "pooled-huge":
        kw["pooled_size"] = ["(46341, 46341)", "2147483646", "(1, 2147483646)", "(65536, 1)",
                             "100000", "(3000, 3000)"][rng.integers(6)]
    rois_dtype = data_dtype = np.dtype(dtype)
    if defect == "dtype-mismatch":
        rois_dtype = [np.float32, np.float64, np.float16][rng.integers(3)]
        if rois_dtype == data_dtype:
            rois_dtype = np.float64 if data_dtype != np.float64 else np.float32
    elif defect == "dtype-int":
        data_dtype = rois_dtype = np.dtype([np.int32, np.int64, np.uint8, np.int8][
            rng.integers(4)])
        if rng.integers(2):
            rois_dtype = np.dtype(dtype)
    with np.errstate(all="ignore"):
        data = np.asarray(data).astype(data_dtype)
        rois = np.asarray(rois).astype(rois_dtype)
        extra = [np.asarray(e).astype(data_dtype) for e in extra]
    return dict(index=index, op=name, kw=kw, door=door, defect=defect, data=data, rois=rois,
                extra=extra, offset=defect == "offset-view", garbage=float(rng.integers(1, 9)))


# ---- one call through one door ----------------------------------------------------------
def _inputs(case, mx):
    arrays = [case["data"], case["rois"], *case["extra"]]
    if case["offset"]:  # an offset view: the second half of a larger buffer
        out = []
        for a in arrays:
            big = mx.nd.array(np.concatenate([a, a]) if a.ndim else a, dtype=a.dtype)
            out.append(big[a.shape[0]:] if a.ndim and a.shape[0] else big)
        return out
    return [mx.nd.array(a, dtype=a.dtype) for a in arrays]


def run_door(case, native):
    """``('ok', [output, gradients...])`` or ``('error', message)`` of the case's call
    (zero-size inputs under ``np_shape``: MXNet's legacy shapes read 0 as unknown)."""
    import mxnet as mx
    arrays = [case["data"], case["rois"], *case["extra"]]
    if any(0 in a.shape for a in arrays):
        with mx.util.np_shape(True):
            return _run_door(case, native)
    return _run_door(case, native)


def _run_door(case, native):
    import mxnet as mx
    op, kw, door = case["op"], case["kw"], case["door"]
    try:
        xs = _inputs(case, mx)
        if door == "sym-train":
            names = ["data", "rois"] + [f"extra{i}" for i in range(len(xs) - 2)]
            syms = [mx.sym.Variable(n) for n in names]
            if native:
                s = getattr(mx.sym, "mx_roi_" + op)(*syms, **kw)
            else:
                s = mx.sym.Custom(*syms, op_type=op, **kw)
            exe = s.simple_bind(mx.cpu(), grad_req={n: ("write" if n == "data" else "null")
                                                     for n in names},
                                type_dict={n: x.dtype for n, x in zip(names, xs)},
                                **{n: x.shape for n, x in zip(names, xs)})
            for n, x in zip(names, xs):
                exe.arg_dict[n][:] = x
            exe.grad_dict["data"][:] = case["garbage"]
            exe.forward(is_train=True)
            head = mx.nd.ones(exe.outputs[0].shape, dtype=exe.outputs[0].dtype)
            exe.backward([head])
            return "ok", [exe.outputs[0].asnumpy(), exe.grad_dict["data"].asnumpy()]
        call = (lambda *a: getattr(mx.nd, "mx_roi_" + op)(*a, **kw)) if native else \
            (lambda *a: mx.nd.Custom(*a, op_type=op, **kw))
        if door == "nd-forward":
            return "ok", [call(*xs).asnumpy()]
        xs[0].attach_grad()
        xs[0].grad[:] = case["garbage"]
        with mx.autograd.record():
            y = call(*xs)
        y.backward()
        return "ok", [y.asnumpy(), xs[0].grad.asnumpy()]
    except mx.MXNetError as exc:
        return "error", str(exc)
    except Exception as exc:  # noqa: BLE001  (a Python-side error before MXNet: kept as is)
        return "error", f"{type(exc).__name__}: {exc}"


def own_lines(message):
    """The extension library's lines of an MXNetError ('\\t[i] ...' of the Extension
    Traceback)."""
    return [line[line.index("] ") + 2:] for line in message.splitlines()
            if line.startswith("\t[")]


def custom_message(message, op):
    """The Custom door's own message (the text of the op's exception: '<op>: ...'), or
    None."""
    m = re.search(r"^\w+Error: (" + re.escape(op) + r": .*?)\n\(raised inside an mx_roi "
                  r"custom op", message, re.S | re.M)
    return m.group(1) if m else None


def _same(a, b):
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        for x, y in zip(a, b))


def classify(case, native, custom):
    """``(class, why)`` of one case from the two doors' results."""
    op = case["op"]
    if native[0] == "ok":
        if custom[0] != "ok":
            return "wrong-silent", f"ran where the Custom door says {custom_message(custom[1], op)!r}"
        if not _same(native[1], custom[1]):
            return "wrong-silent", "output or gradient differs from the Custom door's"
        return "ok", ""
    lines = own_lines(native[1])
    want = custom_message(custom[1], op) if custom[0] == "error" else None
    if custom[0] == "error" and not lines and want is None and \
            f"'mx_roi_{op}'" not in native[1]:
        return "ok", ""  # both refused by MXNet itself, before either door's op
    if custom[0] == "ok":
        return "unclear", f"error where the Custom door runs: {lines or native[1][-300:]!r}"
    want = custom_message(custom[1], op)
    if len(lines) != 1 or not lines[0].startswith(op + ": "):
        return "unclear", f"library lines {lines!r} (Custom: {want!r}; {native[1][-300:]!r})"
    if lines[0] != want:
        return "unclear", f"message {lines[0]!r} differs from the Custom door's {want!r}"
    return "ok", ""


# ---- the child and the parent -------------------------------------------------------------
def good_case(name, op_cls, door="nd-train"):
    from .. import opcheck
    params = dict(op_cls.selftest_cases[0])
    data, rois, _, extra = opcheck.problem(opcheck.make_op(name, params), np.float32, seed=5)
    return dict(index=-1, op=name, kw={k: str(v) for k, v in params.items()}, door=door,
                defect="good", data=data, rois=rois, extra=extra, offset=False, garbage=3.0)


def child(seed, start, stop, ops_filter):
    """Runs cases [start, stop): a 'BEGIN i' line before each, a JSON line after it."""
    os.environ["MX_ROI_BACKEND"] = "native"
    # the oracle: the Custom door's checked path, which shares no host code with the
    # library (mx_roi.cuda.library_calls)
    os.environ["MX_ROI_LIBRARY_CALLS"] = "0"
    from .. import ext
    ext.load()
    ops = {n: o for n, o in ext_ops().items() if not ops_filter or n in ops_filter}
    goods = {n: good_case(n, o) for n, o in ops.items()}
    expected = {n: run_door(g, native=False) for n, g in goods.items()}
    for i in range(start, stop):
        print(f"BEGIN {i}", flush=True)
        case = make_case(seed, i, ops)
        native = run_door(case, native=True)
        custom = run_door(case, native=False)
        cls, why = classify(case, native, custom)
        after = run_door(goods[case["op"]], native=True)
        handover = False
        if cls == "ok" and (after[0] != "ok" or expected[case["op"]][0] != "ok"
                            or not _same(after[1], expected[case["op"]][1])):
            # MXNet's hand-over: the good call raised this case's own message (open)
            handover = after[0] == "error" and native[0] == "error" and \
                own_lines(after[1]) == own_lines(native[1]) != []
            cls, why = "broken-after", f"the next good call gave {after[0]} " \
                                       f"{after[1] if after[0] == 'error' else ''}"[:500]
        print(json.dumps(dict(index=i, op=case["op"], door=case["door"],
                              defect=case["defect"], kw=case["kw"], cls=cls, why=why,
                              handover=handover)),
              flush=True)


def run(cases, seed, per_child=60, ops=(), timeout=600, env=None, first=0, child_cmd=None):
    """Runs ``cases`` cases of ``seed`` (from case ``first``) in child processes; returns
    ``(counts, failures)``.  ``child_cmd(start, stop)``: another child's command line
    (the tests' planted libraries), printing as :func:`child` does."""
    counts = dict.fromkeys(CLASSES, 0)
    failures = []
    start, cases = first, first + cases
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = {**os.environ, **(env or {}), "MX_ROI_BACKEND": "native",
                 "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get(
                     "PYTHONPATH")] if p])}
    while start < cases:
        stop = min(cases, start + per_child)
        cmd = child_cmd(start, stop) if child_cmd else [
            sys.executable, "-m", "mx_roi.ext.fuzz", "--child", "--seed", str(seed),
            "--start", str(start), "--stop", str(stop), "--ops", ",".join(ops)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=child_env,
                                 timeout=timeout, errors="replace")
            out, rc, err = res.stdout, res.returncode, res.stderr
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc, err = "timeout", ""
        begun, done = None, start
        for line in out.splitlines():
            if line.startswith("BEGIN "):
                begun = int(line.split()[1])
            elif line.startswith("{"):
                rec = json.loads(line)
                counts[rec["cls"]] += 1
                if rec["cls"] != "ok":
                    failures.append(rec)
                done = rec["index"] + 1
        if done >= stop and rc == 0:
            start = stop
            continue
        # the child died (or hung) in case `begun` (or before its first case)
        bad = begun if begun is not None and begun >= done else done
        counts["abort"] += 1
        failures.append(dict(index=bad, cls="abort", why=f"child exit {rc}: {err[-800:]}"))
        start = bad + 1
    return counts, failures


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mx_roi.ext.fuzz", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-child", type=int, default=60, help="cases per child process")
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--show", action="store_true", help="print every case that is not ok")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    ops = tuple(o for o in a.ops.split(",") if o)
    if a.child:
        child(a.seed, a.start, a.stop, ops)
        return 0
    counts, failures = run(a.cases, a.seed, a.per_child, ops)
    if a.show:
        for f in failures:
            print(json.dumps(f))
    print(json.dumps(dict(cases=a.cases, seed=a.seed, **counts)))
    return 0 if counts["ok"] == a.cases else 1


if __name__ == "__main__":
    sys.exit(main())
