"""``nitro probe``: run a boostability probe spec through the ``nitro-probe`` flow and print its result."""

from __future__ import annotations


def cmd_probe(args) -> int:
    """``nitro probe SPEC [--report-dir DIR] [key=value ...]``: validates the spec before Prefect
    starts, runs the flow in this process and prints the correlations and the report's path.
    Exit 0: done; 2: invalid spec or a fork that cannot be taken (ProbeError, a ConfigError)."""
    import asyncio

    from nitro.experiments.probe import load_probe_spec

    load_probe_spec(args.spec, args.overrides)  # fail fast, before Prefect starts
    from flows.probe import probe

    result = asyncio.run(probe(spec_path=str(args.spec), overrides=list(args.overrides),
                               report_dir=args.report_dir or ""))
    from nitro.experiments.probe import correlation_line

    print(f"probe {result['probe']}: {len(result['rows'])} branch rounds measured")
    for name, c in result["correlations"].items():
        signal, gain = name.split("~")
        print(f"  Spearman {signal} vs {gain.replace('_', ' ')}: {correlation_line(c)}")
    print(f"report: {result['report_dir']}/README.md   MLflow parent run: {result['parent_run_id']}")
    return 0
