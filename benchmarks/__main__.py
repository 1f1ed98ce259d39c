"""python -m benchmarks: the benchmark sections of jax-gdn, measured into benchmarks/results/<device>.json.

Every name (section, case, column) is checked before anything runs. A run rewrites only the sections it measured
(for a run over some cases, only those rows; for gdn over some columns, only those columns) and keeps everything
else the file holds; each section it writes is stamped under "runs" with the commit, the date and this command.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from benchmarks import results
from benchmarks.sections import SECTIONS

#: the sections whose columns --impls picks
IMPLS_SECTIONS = ("gdn", "backward")


def _parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {s.name:<10} {s.summary}" for s in SECTIONS.values())
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmarks of jax-gdn on this machine's first device, merged into the results JSON.",
        epilog=f"sections:\n{lines}\n\n--all runs every section but sharding (which needs 2 GPUs and writes its own "
               "file)\nand model_35b (a model of half an H200, ~6 min), in the order above. Examples:\n"
               "  python -m benchmarks gdn decode\n"
               "  python -m benchmarks attention --cases prefill-32k\n"
               "  python -m benchmarks --markdown --out benchmarks/results/h200.json")
    p.add_argument("sections", nargs="*", metavar="SECTION", help="sections to measure (see below)")
    p.add_argument("--all", action="store_true", help="every section but sharding and model_35b")
    p.add_argument("--cases", default=None, metavar="NAME,...",
                   help="only these cases of the named sections (gdn, backward, decode, attention, moe; serving: "
                        "its parts); the other rows stored are kept")
    p.add_argument("--impls", default=None, metavar="IMPL,...",
                   help="columns of the gdn or backward section to measure (gdn: pallas, mosaic_gpu, xla, fla, jla, "
                        "qla, fi; default pallas, mosaic_gpu, fla, jla; backward: fwd, ours, ours_xla_vjp, "
                        "xla, fla, qla, jla; default all but qla); the other columns stored are kept")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="results JSON to merge into (default benchmarks/results/<device>.json, <device>x2.json for "
                        "sharding)")
    p.add_argument("--markdown", action="store_true",
                   help="print the results JSON (the named sections, default all) as the README's tables; runs nothing")
    p.add_argument("--plot", action="store_true", help="redraw the gdn rows' PNG beside the results JSON; runs nothing")
    p.add_argument("--merge-from", nargs="+", default=None, metavar="JSON",
                   help="put into --out the sections of these results files stamped later than --out's (the files "
                        "of several GPU calls); runs nothing")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, few calls: a smoke run of the code, not a measurement (written only with --out)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="model: skip the stages that would not fit in this many seconds; sharding: its deadline "
                        "(default 540)")
    p.add_argument("--commit", default=None, help="the commit to stamp (default: git rev-parse of this checkout)")
    return p


def _split(text: str) -> list:
    return [x for x in (text or "").split(",") if x]


def _check_writable(path: str) -> None:
    """Raises ValueError naming ``path`` when the results JSON could not be written there."""
    target = path if os.path.exists(path) else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(target):
        target = os.path.dirname(target)
    if not os.access(target, os.W_OK):
        raise ValueError(f"--out {path}: not writable")
    if os.path.isdir(path):
        raise ValueError(f"--out {path}: is a directory")


def validate(args, parser) -> tuple:
    """(sections to run, case names or None, gdn columns or None); ``parser.error`` (exit 2) on any unknown name
    or combination, before anything runs."""
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    chosen = [s for s in SECTIONS if s in args.sections or (args.all and SECTIONS[s].in_all)]
    if args.merge_from is not None:
        if chosen or args.markdown or args.plot or args.quick or args.cases or args.impls or not args.out:
            parser.error("--merge-from takes --out and nothing else")
        missing = [f for f in args.merge_from if not os.path.isfile(f)]
        if missing:
            parser.error(f"--merge-from: no such file(s) {', '.join(missing)}")
        return chosen, None, None
    if not chosen and not (args.markdown or args.plot):
        parser.error(f"name a section ({', '.join(SECTIONS)}) or --all")
    if (args.markdown or args.plot) and args.cases:
        parser.error("--cases applies to a measurement, not to --markdown / --plot")
    if any(SECTIONS[s].devices > 1 for s in chosen) and len(chosen) > 1 and not (args.markdown or args.plot):
        parser.error("sharding writes its own file (<device>x2.json): run it on its own")
    cases = None
    if args.cases is not None:
        cases = _split(args.cases)
        if not cases:
            parser.error("--cases: no case names given")
        known = {s: SECTIONS[s].case_names(args.quick) for s in chosen if SECTIONS[s].case_names}
        if not known:
            parser.error(f"--cases: none of {', '.join(chosen)} has named cases (gdn, backward, decode, "
                         f"attention, moe, serving do)")
        every = {c for names in known.values() for c in names}
        bad = [c for c in cases if c not in every]
        if bad:
            listing = "; ".join(f"{s}: {', '.join(names)}" for s, names in known.items())
            parser.error(f"unknown case(s) {', '.join(bad)}{' (--quick cases)' if args.quick else ''}; known: "
                         f"{listing}")
    impls = None
    if args.impls is not None:
        with_impls = [s for s in chosen if s in IMPLS_SECTIONS]
        if len(with_impls) != 1 or len(chosen) != 1:
            parser.error(f"--impls applies to one section, gdn or backward; got {', '.join(chosen) or 'none'}")
        mod = SECTIONS[with_impls[0]].load()
        known = tuple(mod.IMPLS) + tuple(getattr(mod, "VARIANTS", ()))
        impls = _split(args.impls)
        bad = [i for i in impls if i not in known]
        if bad or not impls:
            parser.error(f"--impls: unknown {with_impls[0]} column(s) {', '.join(bad) or '(none given)'}; known: "
                         f"{', '.join(known)}")
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget}")
    return chosen, cases, impls


def _keep_unmeasured(rows: list, stored_rows, impls, columns) -> None:
    """--impls: in each new row, every column not in ``impls`` takes its stored row's value again, in "ms",
    "peak_mb" (where the row has it) and "errors"."""
    old = {r["case"]: r for r in stored_rows or []}
    for r in rows:
        was = old.get(r["case"]) or {}
        for key in ("ms", "peak_mb"):
            if key in r:
                r[key] = {i: (r[key][i] if i in impls else (was.get(key) or {}).get(i)) for i in columns}
        if "errors" in r:
            r["errors"] = {**{i: e for i, e in (was.get("errors") or {}).items() if i not in impls}, **r["errors"]}


def _run_one(name: str, quick: bool, cases, impls, stored: dict, budget):
    """Measures section ``name``; returns {key: value} to store (merged with ``stored`` where only some cases or
    columns were measured)."""
    sec = SECTIONS[name]
    mod = sec.load()
    if name == "gdn":
        kw = {} if impls is None else {"impls": impls}
        rows = mod.run_section(quick, cases=cases, **kw)
        if impls is not None:                       # the columns not measured keep their stored figures
            _keep_unmeasured(rows, stored.get("rows"), impls, mod.IMPLS)
            old = {r["case"]: r for r in stored.get("rows") or []}
            for r in rows:
                was = old.get(r["case"]) or {}
                if "fla" not in impls and "fla_do_bench" in was:
                    r["fla_do_bench"] = was["fla_do_bench"]
                kept = {n: ms for n, ms in (was.get("variants") or {}).items() if n not in impls}
                if kept or "variants" in r:               # the A/B columns not measured keep theirs too
                    r["variants"] = {**kept, **(r.get("variants") or {})}
        mod.print_section(rows)
        if cases is not None:
            rows = results.merge_rows(stored.get("rows"), rows, sec.case_names(False))
        return {"rows": rows}
    if name in ("backward", "decode", "attention", "moe"):
        value = mod.run_section(quick, cases=cases, **({} if impls is None else {"impls": impls}))
        if impls is not None:                       # the columns not measured keep their stored figures
            _keep_unmeasured(value["rows"], (stored.get(sec.keys[0]) or {}).get("rows"), impls, mod.IMPLS)
        mod.print_section(value)
        if cases is not None and stored.get(sec.keys[0]):
            value = dict(value, rows=results.merge_rows(stored[sec.keys[0]].get("rows"), value["rows"],
                                                        sec.case_names(False)))
        return {sec.keys[0]: value}
    if name == "layers":
        value = mod.run_section(quick)
        if not value:
            raise RuntimeError("no backend of the layers section ran")
        mod.print_section(value)
        return {"layers": value}
    if name in ("model", "model_35b"):
        value = mod.run_section(quick, budget_s=budget, dims=mod.SECTION_DIMS[name])
        mod.print_section(value)
        return {sec.keys[0]: value}
    if name in ("serving", "serving_35b"):
        key, full = mod.SECTION_SIZES[name]
        value = mod.run_section(quick, cases=cases, full=full)
        mod.print_section(value)
        if cases is not None:                       # the parts not run keep their stored figures
            value = {**(stored.get(key) or {}), **value}
        return {key: value}
    if name == "train":
        value = mod.run_section(quick)
        mod.print_section(value)
        return {"train": value}
    if name == "sharding":
        value = mod.run_section(quick, **({} if budget is None else {"deadline_s": budget}))
        mod.print_section(value)
        return value
    raise ValueError(name)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    chosen, cases, impls = validate(args, parser)
    devices = max((SECTIONS[s].devices for s in chosen), default=1)
    if args.merge_from is not None:
        try:
            _check_writable(args.out)
            target = results.load(args.out)
            taken = results.merge_files(target, [results.load(f) for f in args.merge_from])
        except ValueError as err:
            parser.error(str(err))
        results.write(target, args.out)
        print(f"{args.out}: took {', '.join(taken) or 'nothing (no newer section)'}")
        return 0
    if args.markdown or args.plot:
        path = args.out or results.default_path(results.device_kind(), devices)
        data = results.load(path)
        if not data:
            parser.error(f"--out {path}: no results file there")
        if args.plot:
            from benchmarks import gdn
            gdn.plot(data, path[:-5] + ".png" if path.endswith(".json") else path + ".png")
        if args.markdown:
            from benchmarks.report import markdown_tables
            print(markdown_tables(data, chosen or None))
        return 0
    if {"model", "model_35b"} & set(chosen):   # their HF child shares the GPU: JAX takes memory as it goes
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    if devices > 1 and len(jax.devices()) < devices:
        print(f"python -m benchmarks: sharding needs {devices} devices, this machine has {len(jax.devices())} "
              f"({jax.devices()[0].platform}); on a CPU, a --quick dry run takes XLA_FLAGS="
              "--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu", file=sys.stderr)
        return 2
    kind = results.device_kind()
    path = args.out or (None if args.quick else results.default_path(kind, devices))
    if path is not None:
        try:
            _check_writable(path)
            stored = results.load(path)
        except ValueError as err:
            parser.error(str(err))
    else:
        stored = {}
        print("--quick without --out: nothing is written")
    commit_id = args.commit or results.commit()
    done, failed = [], []
    for name in chosen:
        print(f"== section {name}", flush=True)
        t0 = time.time()
        try:
            value = _run_one(name, args.quick, cases, impls, stored, args.budget)
        except Exception as err:                                  # report and go on with the other sections
            traceback.print_exc()
            failed.append((name, f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
                           time.time() - t0))
            continue
        mark = results.stamp(argv, commit_id)
        runs = stored.setdefault("runs", {})
        if name == "sharding":
            run = 1 + max((int(k) for k in runs if str(k).isdigit()), default=0)
            stored.update(SECTIONS[name].load().merge(stored, value, run))
            stored["method"] = value["method"]
            runs[str(run)] = mark
            device = f"{kind} x{devices}"
        else:
            stored.update(value)
            for key in value:
                runs[key] = mark
            device = kind
        stored.update({"device": device, "jax": jax.__version__, "date": mark["date"]})
        if path is not None:
            results.write(stored, path)
            if name == "gdn":
                SECTIONS["gdn"].load().plot(stored, path[:-5] + ".png" if path.endswith(".json") else path + ".png")
        done.append((name, time.time() - t0))
    print(f"\n{'section':<10} {'s':>6}  result")
    for name, s in done:
        print(f"{name:<10} {s:6.0f}  ok{' -> ' + path if path else ''}")
    for name, why, s in failed:
        print(f"{name:<10} {s:6.0f}  FAILED: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
