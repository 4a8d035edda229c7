"""``spec-serve capture`` and ``spec-serve cache stats|verify|prune``: the flags; the work is in
spec_serve/cache/capture.py and spec_serve/cache/admin.py (imported when a command runs: ``--help`` stays
cheap)."""

from __future__ import annotations

import json

import click

from spec_serve.protocol.commands import FRONTEND_PORT
from spec_serve.telemetry import logs


@click.command()
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSON lines, one row a line: {\"input_ids\": [...]}.")
@click.option("--cache", "cache_dir", required=True, envvar="SPEC_SERVE_CACHE",
              help="The cache directory to fill (created if need be) [env SPEC_SERVE_CACHE].")
@click.option("--broker", "broker_url", default=f"tcp://127.0.0.1:{FRONTEND_PORT}", envvar="SPEC_SERVE_CLIENT_BROKER",
              show_default=True, help="The broker's frontend [env SPEC_SERVE_CLIENT_BROKER].")
@click.option("--service", default="default", envvar="SPEC_SERVE_SERVICE", show_default=True,
              help="The target's service [env SPEC_SERVE_SERVICE].")
@click.option("--kind", default="eagle3", type=click.Choice(["eagle3", "dspark"]), show_default=True,
              help="The supervision to capture (EAGLE-3 is kept compact: any vocab mapping expands it later).")
@click.option("--batch-tokens", default=16384, type=click.IntRange(min=1), show_default=True,
              help="Padded tokens a request holds at most (rows are batched longest first).")
@click.option("--max-rows", default=64, type=click.IntRange(min=1), show_default=True,
              help="Rows a request holds at most.")
@click.option("--in-flight", default=None, type=click.IntRange(min=1),
              help="Requests outstanding at once [default: 2 per worker of the service].")
@click.option("--cache-dtype", default="native", type=click.Choice(["native", "fp8"]), envvar="SPEC_SERVE_CACHE_DTYPE",
              show_default=True, help="How hidden states are stored (docs/cache.md) [env SPEC_SERVE_CACHE_DTYPE].")
@click.option("--timeout", default=600.0, type=click.FloatRange(min=0, min_open=True), show_default=True,
              help="Seconds one request may take.")
def capture(data, cache_dir, broker_url, service, kind, batch_tokens, max_rows, in_flight, cache_dtype, timeout):
    """Run a dataset through the running workers into a supervision cache (offline mode).

    Every worker of the service takes part; rows already cached are skipped, so a second run resumes
    where an interrupted one stopped. Training with RemoteTargetModel(cache=DIR) (or SPEC_SERVE_CACHE)
    then reads these rows instead of asking the workers.

    \b
    Examples:
      spec-serve capture --data train.jsonl --cache /shared/cache/llama8b
      spec-serve capture --data train.jsonl --cache /shared/cache/llama8b --kind dspark --in-flight 16
      spec-serve capture --data train.jsonl --cache /nvme/cache --cache-dtype fp8 --broker tcp://10.0.0.1:5555
    """
    from spec_serve.cache.capture import capture as run
    from spec_serve.cache.capture import read_rows
    from spec_serve.client.api import RemoteTargetModel

    logs.setup("WARNING")
    try:
        rows = read_rows(data)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    with RemoteTargetModel(broker_url, service=service, timeout=timeout) as probe:
        workers = len([w for w in probe.status(service)["workers"] if w["service"] == service])
    depth = in_flight or max(2, 2 * workers)
    with RemoteTargetModel(broker_url, service=service, timeout=timeout, cache=cache_dir, cache_dtype=cache_dtype,
                           prefetch_depth=depth) as client:
        summary = run(client, rows, kind, batch_tokens, max_rows)
    click.echo(json.dumps({**summary, "workers": workers, "in_flight": depth, "cache": str(cache_dir)}))


@click.group()
def cache():
    """Inspect and trim a supervision cache directory (docs/cache.md).

    \b
    Examples:
      spec-serve cache stats /shared/cache/llama8b
      spec-serve cache verify /shared/cache/llama8b
      spec-serve cache prune /shared/cache/llama8b --max-bytes 2000000000000
    """


@cache.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def stats(directory, as_json):
    """Entries, bytes, bytes per token (per kind), partial files, and the hit rate clients recorded.

    \b
    Examples:
      spec-serve cache stats /shared/cache/llama8b
      spec-serve cache stats /shared/cache/llama8b --json
    """
    from spec_serve.cache import admin

    try:
        figures = admin.stats(directory)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    click.echo(f"{figures['dir']}: {figures['rows']} rows in {figures['entries']} entries, {figures['segments']} "
               f"segments, {figures['bytes']:,} bytes, {figures['partial_files']} partial files")
    for label, c in figures["kinds"].items():
        click.echo(f"  {label:<22} {c['entries']:>9} entries {c['tokens']:>12,} tokens "
                   f"{c['bytes_per_token']:>10,.0f} bytes/token")
    rate = figures["clients"]["hit_rate"]
    click.echo(f"  hit rate {'-' if rate is None else f'{rate:.1%}'} over {figures['clients'].get('hits', 0)} hits, "
               f"{figures['clients'].get('misses', 0)} misses (clients that closed)")
    for line in figures["unreadable_segments"]:
        click.echo(f"  unreadable: {line}")


@cache.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def verify(directory):
    """Read every entry and check its digest; exit 1 if one fails.

    \b
    Examples:
      spec-serve cache verify /shared/cache/llama8b
    """
    from spec_serve.cache import admin

    try:
        result = admin.verify(directory)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    for line in result["bad"]:
        click.echo(f"bad: {line}")
    click.echo(f"{result['checked']} entries checked, {len(result['bad'])} bad (digests checked: {result['checked']})")
    if result["bad"]:
        raise SystemExit(1)


@cache.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--max-bytes", default=None, type=click.IntRange(min=0),
              help="Evict whole segments, oldest first, until the rest hold at most this many bytes.")
@click.option("--partials-older-than", default=3600.0, type=click.FloatRange(min=0), show_default=True,
              help="Remove partial files untouched this many seconds (left by killed writers).")
def prune(directory, max_bytes, partials_older_than):
    """Evict old segments down to a size, and remove partial files of killed writers.

    \b
    Examples:
      spec-serve cache prune /shared/cache/llama8b --max-bytes 500000000000
      spec-serve cache prune /shared/cache/llama8b --partials-older-than 0
    """
    from spec_serve.cache import admin

    try:
        result = admin.prune(directory, max_bytes, partials_older_than)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"evicted {len(result['evicted_segments'])} segments, removed {len(result['removed_partials'])} "
               f"partial files")
