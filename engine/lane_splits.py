"""The prefill lane's SM splits by decode batch (issue 43): how many SMs a lane job leaves its decode steps.

`EngineConfig.sm_split_decode_sms` is one number of SMs for every job, or a table {decode rows up to: decode-lane
SMs}, e.g. {32: 32, 128: 64}: a job that starts beside 1-32 decoding rows leaves them 32 SMs (its prompt gets the
rest), one beside more rows 64; rows above the largest bound take its entry. The split chosen when a job starts
holds until it ends: while a job runs no prompt joins the decode batch (prompts wait for the lane), so the batch
can only shrink under it.

Why a table: on one H200 (8B shape, chat workload served; docs/benchmarks.md "One GPU, both phases") 32 decode SMs
gave prompts the better TTFT at 4-8 req/s (~8-16 rows decoding) but the streams a 31 ms TPOT at 12 req/s (~60+
rows), where 64 SMs kept 18 ms; and at 4 req/s chunked prefill beat both (the lane's prompts get fewer SMs while
few streams need protecting): hence rows of 0. Owns only the table's form and lookup; engine.runner.prefill_lane
makes the splits.
"""

from __future__ import annotations

import sys

SplitTable = tuple[tuple[int, int], ...]  # ((decode rows up to, decode-lane SMs), ...), bounds ascending
ANY_BATCH = sys.maxsize  # the bound of a single number's one row


def split_table(value: int | dict | tuple) -> SplitTable:
    """`sm_split_decode_sms` as a table (() for 0: off). ValueError saying what is wrong with `value`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must be 0 (off), a number of SMs or a table {decode rows up to: SMs}")
        return () if value == 0 else ((ANY_BATCH, value),)
    if not isinstance(value, dict | tuple | list):
        raise ValueError("must be 0 (off), a number of SMs or a table {decode rows up to: SMs}")
    rows = value.items() if isinstance(value, dict) else value
    try:
        table = tuple(sorted((bound, sms) for bound, sms in rows))
    except (TypeError, ValueError):
        raise ValueError("must be 0 (off), a number of SMs or a table {decode rows up to: SMs}") from None
    if not table:
        raise ValueError("a table needs at least one row {decode rows up to: SMs}")
    for bound, sms in table:
        for what, n, least in (("decode rows", bound, 1), ("SMs", sms, 0)):
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                raise ValueError(f"a table's {what} must be integers >= {least} (the row {bound!r}: {sms!r})")
    if len({bound for bound, _ in table}) != len(table):
        raise ValueError("a table names each decode-row bound once")
    if not any(sms for _, sms in table):
        raise ValueError("a table whose rows are all 0 SMs never uses the lane: write 0 (off)")
    return table


def decode_sms_for(table: SplitTable, decode_rows: int) -> int:
    """The decode lane's SMs for a job that starts beside `decode_rows` decoding rows (0: no job; chunked)."""
    return next((sms for bound, sms in table if decode_rows <= bound), table[-1][1])


def fewest_lane_rows(table: SplitTable) -> int:
    """The fewest decoding rows (>= 1) beside which a job takes the lane (after the table's leading rows of 0)."""
    rows = 1
    for bound, sms in table:
        if sms:
            return rows
        rows = bound + 1
    return rows  # (unreached: split_table refuses a table of only 0 rows)
