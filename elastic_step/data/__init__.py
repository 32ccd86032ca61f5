"""The data: prep writes Parquet shards and their manifest (prep.py, parse.py, shuffle.py, column_stats.py; the
format in manifest.py); training reads record ranges of them (reader.py) and accounts for each record it applied
(accounting.py)."""


def statistics(uri: str) -> dict[str, dict]:
    """The per-column statistics `elastic-step data prep` recorded for a split, from its manifest (a manifest.json
    or its folder, any fsspec URI): {column: {"count", "mean", "variance", "min", "max"}} for numbers and
    {column: {"vocabulary", "counts", "complete"}} for strings and integer ids (both for integers). What a
    model(statistics) receives when it trains elastically, for the same module under plain `fit`."""
    from elastic_step.data.column_stats import read_statistics

    return read_statistics(uri)


def statistics_of(uri: str):
    """() -> the statistics of the manifest at `uri`, read when called (None without a `uri`): what a model
    definition is given to hand a model(statistics) (model_def.py, which sits beside this package)."""
    return (lambda: statistics(uri)) if uri else None
