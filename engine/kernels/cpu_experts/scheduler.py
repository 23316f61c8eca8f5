"""The work scheduler: threads take (expert, block of rows) items from atomic counters, phase after phase."""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from engine.kernels.cpu_experts.atomics import _bytes_at, _fetch_add, _wait_for
from engine.kernels.cpu_experts.meta import M_IN, M_OUT
from engine.kernels.cpu_experts.rows import _lay_out, _lay_out_bf16, _rows, _swiglu_laid_out

# Rows a work item (_layer_part): on the H200 machine's Xeon, 15 threads, a decode layer of 8 experts took 201 us
# with 64 against 228 with 32 (the atomics and the calls' fixed costs are shared by more bytes)
ITEM_ROWS = 64
COUNTER_STRIDE = 16  # int32s between a layer's counters: each on its own 64-byte line


@numba.njit(nogil=True, cache=True)
def _take(counter_at, experts, blocks):
    """The next item (expert, block) of a phase from its counter, or (-1, 0) once all are taken."""
    item = _fetch_add(counter_at, 1)
    if item >= experts * blocks:
        return -1, 0
    return item // blocks, item % blocks


@numba.njit(nogil=True, cache=True)
def _record(base, expert, record_bytes):
    """An expert's record, from its layer's records at address `base`."""
    return numba.carray(_bytes_at(base + expert * record_bytes), (record_bytes,))


# A layer's experts for its tokens are computed by threads that take work items from atomic counters: the
# CPU share's threads (cpu_share.py) run each of a step's layers through _layer_part, and run() a call the
# same way, in one parallel region. Counters, COUNTER_STRIDE int32s apart: gate_up items taken, groups
# activated, down items taken and ended, sum items taken and ended, the finisher of a layer with nothing for
# the CPU; then per group its gate_up items ended
TAKEN_GATE_UP, ACTIVATED, TAKEN_DOWN, ENDED_DOWN, TAKEN_SUM, ENDED_SUM, FINISHER, ENDED_GATE_UP = range(8)
SUM_TOKENS = 16  # tokens a sum item


class LayerRecords(NamedTuple):
    """A layer's expert records as the kernels read them: expert e's at base + e * record_bytes."""

    base: int  # the address of expert 0's record
    record_bytes: int
    meta: np.ndarray  # int64 [2, META_FIELDS]: gate_up's fields, then down's


class Groups(NamedTuple):
    """The assignments for the CPU grouped by expert, as _group_rows fills them."""

    count: int
    experts: np.ndarray  # group g is expert experts[g]
    starts: np.ndarray  # ...for rows starts[g]..starts[g + 1] - 1
    token_of_row: np.ndarray  # row r is for token token_of_row[r]
    row_of: np.ndarray  # [T, k]: assignment (t, j)'s row, -1 off the CPU


class Tokens(NamedTuple):
    """A layer's tokens: their routing weights [T, k], inputs laid out [T, H] (and as bf16), and the sum out [T, H]."""

    weights: np.ndarray
    laid: np.ndarray
    laid16: np.ndarray
    out: np.ndarray


class RowBuffers(NamedTuple):
    """Per-row results [rows, ...] the threads of a layer share: gate_up's, the activations, down's."""

    hidden_rows: np.ndarray
    acts: np.ndarray
    acts16: np.ndarray
    outputs: np.ndarray
    own_rows: np.ndarray  # 0..rows-1: down's rows read the activations of their own row


@numba.njit(nogil=True, cache=True)
def _counter(counters_at, which):
    """The address of counter `which` of a layer whose counters start at `counters_at`."""
    return counters_at + 4 * COUNTER_STRIDE * which


@numba.njit(nogil=True, cache=True)
def _group_rows(expert_ids, on_cpu, num_experts, counts, group_experts, starts, token_of_row, row_of):
    """The assignments marked on_cpu [T, k] grouped by expert (a counting sort): group g is expert
    group_experts[g] for rows starts[g]..starts[g+1]-1, row r is for token token_of_row[r], and
    row_of[t, j] is assignment (t, j)'s row (-1 off the CPU). counts: int64 [num_experts + 1], scratch. The
    number of groups, or -1 if an expert id is outside 0..num_experts-1."""
    tokens, top_k = expert_ids.shape
    counts[:] = 0
    for t in range(tokens):
        for j in range(top_k):
            if on_cpu[t, j]:
                e = expert_ids[t, j]
                if e < 0 or e >= num_experts:
                    return -1
                counts[e + 1] += 1
    groups, rows = 0, 0
    for e in range(num_experts):
        if counts[e + 1]:
            group_experts[groups], starts[groups] = e, rows
            rows += counts[e + 1]
            counts[e + 1] = starts[groups]  # from here: where the expert's next row goes
            groups += 1
    starts[groups] = rows
    for t in range(tokens):
        for j in range(top_k):
            row_of[t, j] = -1
            if on_cpu[t, j]:
                row = counts[expert_ids[t, j] + 1]
                counts[expert_ids[t, j] + 1] += 1
                token_of_row[row], row_of[t, j] = t, row
    return groups


@numba.njit(nogil=True, cache=True)
def _next_item(counter_at, records, grouped, items, matrix, inputs, inputs16, picks, results, bf16):
    """Take a phase's next item from its counter and compute it: rows item * ITEM_ROWS onwards of a group's
    `matrix` (a LayerRecords' records), for each of the group's rows r the inputs of picks[r], into
    results[r]. The group, or -1 once every item is taken."""
    g, item = _take(counter_at, grouped.count, items)
    if g >= 0:
        first, last = grouped.starts[g], grouped.starts[g + 1]
        _rows(
            _record(records.base, grouped.experts[g], records.record_bytes),
            matrix,
            item * ITEM_ROWS,
            min((item + 1) * ITEM_ROWS, matrix[M_OUT]),
            inputs,
            inputs16,
            picks[first:last],
            results[first:last],
            bf16,
        )
    return g


@numba.njit(nogil=True, cache=True)
def _layer_part(records, grouped, layer_tokens, buffers, counters_at, bf16, cancel_at):
    """Compute one thread's part of a layer's experts (a LayerRecords, Groups, Tokens and RowBuffers).

    It takes gate_up items (ITEM_ROWS rows of one group; whoever ends a group's last one computes its rows'
    activations) and waits for every group's; takes down items the same way and waits for all to end; then
    takes sum items (SUM_TOKENS tokens: out[t] = the sum over j of weights[t, j] times row row_of[t, j]'s
    output). The buffers and out are shared by the threads. The rows computed if this thread ended the last
    sum item, else 0; -1 once the int32 at cancel_at is set."""
    groups, starts, row_of = grouped.count, grouped.starts, grouped.row_of
    weights, laid, laid16, out = layer_tokens
    hidden_rows, acts, acts16, outputs, own_rows = buffers
    gate_up, down = records.meta[0], records.meta[1]
    hidden, intermediate = down[M_OUT], down[M_IN]
    per_group = (2 * intermediate + ITEM_ROWS - 1) // ITEM_ROWS
    down_items = (hidden + ITEM_ROWS - 1) // ITEM_ROWS
    act = np.empty(intermediate, np.float32)
    while True:
        g = _next_item(
            _counter(counters_at, TAKEN_GATE_UP),
            records,
            grouped,
            per_group,
            gate_up,
            laid,
            laid16,
            grouped.token_of_row,
            hidden_rows,
            bf16,
        )
        if g < 0:
            break
        if _fetch_add(_counter(counters_at, ENDED_GATE_UP + g), 1) == per_group - 1:
            for row in range(starts[g], starts[g + 1]):
                _swiglu_laid_out(hidden_rows[row], act, acts[row], acts16[row], down, bf16)
            _fetch_add(_counter(counters_at, ACTIVATED), 1)
    if _wait_for(_counter(counters_at, ACTIVATED), groups, cancel_at) < 0:
        return -1
    while (
        _next_item(
            _counter(counters_at, TAKEN_DOWN), records, grouped, down_items, down, acts, acts16, own_rows, outputs, bf16
        )
        >= 0
    ):
        _fetch_add(_counter(counters_at, ENDED_DOWN), 1)
    if _wait_for(_counter(counters_at, ENDED_DOWN), groups * down_items, cancel_at) < 0:
        return -1
    tokens, top_k = row_of.shape
    sum_items = (tokens + SUM_TOKENS - 1) // SUM_TOKENS
    while True:
        item = _fetch_add(_counter(counters_at, TAKEN_SUM), 1)
        if item >= sum_items:
            return 0
        for t in range(item * SUM_TOKENS, min((item + 1) * SUM_TOKENS, tokens)):
            out[t, :] = 0
            for j in range(top_k):
                row = row_of[t, j]
                if row >= 0:
                    weight = weights[t, j]
                    for r in range(hidden):
                        out[t, r] += weight * outputs[row, r]
        if _fetch_add(_counter(counters_at, ENDED_SUM), 1) == sum_items - 1:
            return starts[groups]


@numba.njit(parallel=True, nogil=True, cache=True)
def _experts(records, meta, x, expert_ids, expert_weights, on_cpu, out, bf16, threads):
    """out [T, H] = each token's weighted sum of its experts marked on_cpu, by `threads` threads taking items;
    False if an expert id is outside the records."""
    tokens, top_k = expert_ids.shape
    num_experts, assignments = records.shape[0], tokens * top_k
    group_experts, starts = np.empty(assignments, np.int64), np.empty(assignments + 1, np.int64)
    token_of_row, row_of = np.empty(assignments, np.int64), np.empty((tokens, top_k), np.int64)
    groups = _group_rows(
        expert_ids,
        on_cpu,
        num_experts,
        np.empty(num_experts + 1, np.int64),
        group_experts,
        starts,
        token_of_row,
        row_of,
    )
    if groups <= 0:
        return groups == 0
    rows = starts[groups]
    hidden, intermediate = meta[1][M_OUT], meta[1][M_IN]
    laid = np.empty((tokens, hidden), np.float32)
    laid16 = np.empty((tokens if bf16 else 0, hidden), np.uint16)
    for t in range(tokens):
        _lay_out(x[t], laid[t], meta[0])
        if bf16:
            _lay_out_bf16(x[t], laid16[t])
    counters = np.zeros((ENDED_GATE_UP + groups) * COUNTER_STRIDE, np.int32)
    never = np.zeros(1, np.int32)  # nothing cancels a call
    hidden_rows = np.empty((rows, 2 * intermediate), np.float32)
    acts, acts16 = np.empty((rows, intermediate), np.float32), np.empty((rows, intermediate), np.uint16)
    outputs, own_rows = np.empty((rows, hidden), np.float32), np.arange(rows)
    base, record_bytes = np.int64(records.ctypes.data), records.shape[1]
    for _ in numba.prange(threads):
        _layer_part(
            LayerRecords(base, record_bytes, meta),
            Groups(groups, group_experts, starts, token_of_row, row_of),
            Tokens(expert_weights, laid, laid16, out),
            RowBuffers(hidden_rows, acts, acts16, outputs, own_rows),
            counters.ctypes.data,
            bf16,
            never.ctypes.data,
        )
    return True
