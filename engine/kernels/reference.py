"""Plain-PyTorch kernels: the reference every device-specific kernel is checked against.

Shapes are batch-free (one sequence): tokens first, then heads, then features.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.checkpoint.formats import StoredWeight
from engine.kernels.groups import ExpertGroups
from engine.kernels.slot_table import SlotTable

GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule
GDN_GROUP_TOKENS = 8 * GDN_CHUNK  # chunks computed together; the planner budgets one group's temporaries
# Attention over an FP8 KV cache in query x key blocks (online softmax): only one block of keys is ever
# dequantised, so the cache stays one byte a value. The planner budgets these blocks (engine/runtime/planner.py).
ATTENTION_QUERY_BLOCK = 128
ATTENTION_KEY_BLOCK = 512


def linear(x: torch.Tensor, weight: StoredWeight, swiglu: bool = False) -> torch.Tensor:
    """x @ W^T with W dequantised to x's dtype; with swiglu the input is silu_mul(x)."""
    if swiglu:
        x = silu_mul(x)
    return F.linear(x, weight.dequantize(x.dtype))


def grouped_linear(x: torch.Tensor, weight: StoredWeight, groups: ExpertGroups) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[-2])
    for slot, begin, end in groups:
        out[begin:end] = linear(x[begin:end], weight.select(slot))
    return out


def slot_linear(x: torch.Tensor, weight: StoredWeight, slots: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    if swiglu:
        x = silu_mul(x)
    out = x.new_empty(x.shape[0], weight.shape[-2])
    for row, slot in enumerate(slots.tolist()):
        out[row : row + 1] = linear(x[row : row + 1], weight.select(slot))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: silu(gate) * up of [..., 2I] rows holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm in float32; `offset` 1.0 gives the zero-centred (1 + weight) variant."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (offset + weight.float())).to(x.dtype)


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x [T, C], continuing from conv_state [C, K-1] (updated in place)."""
    kernel = weight.shape[-1]
    history = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    conv_state.copy_(history[:, -(kernel - 1) :])
    out = F.conv1d(history.unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=x.shape[1])
    return F.silu(out[0].t())


def delta_chunk_states(new_v, w, k_to_end, end_decay, s):
    """The chunked rule's one sequential part: from the state s [H, Dk, Dv], turn each chunk's U (new_v [N, H, L,
    Dv], in place) into u = U - W S and carry S to the next chunk, S <- end_decay S + K_to_end u. w [N, H, L, Dk],
    k_to_end [N, H, Dk, L], end_decay [N, H, 1, 1]. Returns the states entering each chunk and the last one's
    result, [N + 1, H, Dk, Dv]."""
    states = s.new_empty(new_v.shape[0] + 1, *s.shape)
    states[0] = s
    for chunk in range(new_v.shape[0]):
        new_v[chunk].baddbmm_(w[chunk], states[chunk], alpha=-1.0)
        torch.mul(states[chunk], end_decay[chunk], out=states[chunk + 1])
        states[chunk + 1].baddbmm_(k_to_end[chunk], new_v[chunk])
    return states


def gated_delta_rule(q, k, v, g, beta, state, recurrence=delta_chunk_states):
    """Gated delta rule over T tokens, continuing from `state` [Hv, Dk, Dv] (updated in place).

    q, k: [T, Hv, Dk] (already L2-normalised; q already scaled); v: [T, Hv, Dv];
    g: [T, Hv] log-decay (<= 0); beta: [T, Hv]. Returns o [T, Hv, Dv] in float32.
    The state evolves as S <- exp(g) S + k (beta (v - exp(g) S^T k))^T and o = S^T q.
    """
    if q.shape[0] == 1 and state.dtype == torch.float32:  # in place: a decode step makes no state-sized temporaries
        q, k, v, g, beta = (t[0].float() for t in (q, k, v, g, beta))
        state.mul_(g.exp()[:, None, None])
        delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", state, k))
        state.baddbmm_(k[:, :, None], delta[:, None, :])
        return torch.einsum("hkv,hk->hv", state, q).unsqueeze(0)
    s = state.float()
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, q.shape[0], GDN_GROUP_TOKENS):  # groups bound the temporaries, whatever the prompt
        end = min(start + GDN_GROUP_TOKENS, q.shape[0])
        whole = end - (end - start) % GDN_CHUNK
        for first, last, length in ((start, whole, GDN_CHUNK), (whole, end, end - whole)):
            if last > first:  # the whole chunks together, then a shorter last one
                chunked = (_chunk_major(t[first:last], length) for t in (q, k, v, g, beta))
                o, s = _delta_chunks(*chunked, s, recurrence)
                out[first:last].unflatten(0, (-1, length)).copy_(o.transpose(1, 2))
    state.copy_(s)
    return out


def _chunk_major(t: torch.Tensor, length: int) -> torch.Tensor:
    """Copy token-first [T, H, ...] into [T / length, H, length, ...] in float32, each chunk's heads contiguous."""
    return t.float().unflatten(0, (-1, length)).transpose(1, 2).clone(memory_format=torch.contiguous_format)


def gated_deltanet(
    qkv,
    z,
    b,
    a,
    conv_state,
    conv_weight,
    recurrent,
    a_log,
    dt_bias,
    norm_weight,
    eps,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    recurrence=delta_chunk_states,
):
    """A Gated DeltaNet layer between its input and output projections, as GatedDeltaNet composes it.

    qkv [T, conv channels], z [T, value heads * value dim], b, a [T, value heads] are the projections (activation
    dtype); conv_state [channels, K-1] and recurrent [value heads, key dim, value dim] (float32) are updated in
    place. Returns the gated, normalised o [T, value heads * value dim] in qkv's dtype. `recurrence`: the chunked
    rule's sequential part (delta_chunk_states).
    """
    tokens, keys = qkv.shape[0], key_heads * key_dim
    qkv = causal_conv1d(qkv, conv_state, conv_weight)
    q, k, v = qkv.split([keys, keys, value_heads * value_dim], dim=-1)

    def per_value_head(t):  # L2-normalised in float32; each key head serves value_heads // key_heads value heads
        t = t.view(tokens, key_heads, 1, key_dim).float()
        t = t * torch.rsqrt((t * t).sum(dim=-1, keepdim=True) + 1e-6)
        return t.expand(tokens, key_heads, value_heads // key_heads, key_dim).reshape(tokens, value_heads, key_dim)

    q = per_value_head(q) * key_dim**-0.5
    k = per_value_head(k)
    v = v.view(tokens, value_heads, value_dim)
    beta = torch.sigmoid(b.float())
    decay = -a_log.exp() * F.softplus(a.float() + dt_bias)
    out = gated_delta_rule(q, k, v, decay, beta, recurrent, recurrence).to(qkv.dtype)
    del q, k, v  # the norm's float32 temporaries take their place
    z = z.reshape(tokens, value_heads, value_dim)
    out = rms_norm(out, norm_weight, eps, 0.0) * F.silu(z.float()).to(qkv.dtype)
    return out.reshape(tokens, -1)


def _delta_chunks(q, k, v, g, beta, s, recurrence=delta_chunk_states):
    """Run the rule over N chunks of L tokens each ([N, H, L, ...]) from the state s [H, Dk, Dv], in closed form.

    With G the inclusive cumulative log-decay inside a chunk and A strictly lower triangular with
    A_ij = beta_i exp(G_i - G_j) k_i.k_j, the values a chunk writes to its entering state S are
    u = U - W S, where U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta exp(G)) K do not depend on S;
    then o_i = exp(G_i) S^T q_i + sum_{j<=i} exp(G_i - G_j)(q_i.k_j) u_j. Everything but u and the states is
    computed for all chunks at once; the loop over chunks is `recurrence` (delta_chunk_states' contract: three
    small kernels a chunk in the reference, one kernel in all on CUDA). Returns o [N, H, L, Dv] and the state
    after the last chunk; k is overwritten.
    """
    chunks, length = k.shape[0], k.shape[2]
    cum = g.cumsum(dim=-1)  # [N, H, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # zero above
    # A below the diagonal; unitriangular=True reads the diagonal as ones, so this is solved as I + A
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., None])
    identity = torch.eye(length, dtype=q.dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True).mul_(beta[..., None, :])
    del system
    new_v = inverse @ v  # U, which the loop turns into u chunk by chunk
    w = inverse.mul_(cum.exp()[..., None, :]) @ k
    del inverse
    scores = decay.mul_(q @ k.transpose(-1, -2))  # exp(G_i - G_j) q_i.k_j, j <= i
    k_to_end = k.mul_((cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # each key decayed to its chunk's end
    end_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]
    states = recurrence(new_v, w, k_to_end, end_decay, s)
    del w
    o = (q @ states[:chunks]).mul_(cum.exp()[..., None])
    o.flatten(0, 1).baddbmm_(scores.flatten(0, 1), new_v.flatten(0, 1))
    return o, states[chunks]


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, its rms_norm): a decoder layer's residual sum and the norm of it that the next block reads."""
    total = x + y
    return total, rms_norm(total, weight, eps, offset)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """Each head's RMSNorm of x [T, H, D] (rms_norm), then the rotary embedding of positions [T] on its first
    2 * len(inv_freq) features (rotate-half layout), cos and sin and the products in x's dtype; the rest pass."""
    x = rms_norm(x, weight, eps, offset)
    rotary = 2 * inv_freq.numel()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, rotary]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    rot, rest = x[..., :rotary], x[..., rotary:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat([-second, first], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1)


def router_topk(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], weights [T, k] float32): the k most probable experts of softmax(logits) in float32,
    most probable first, their probabilities divided by their sum when `normalise`."""
    weights, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def assign_slots(
    ids: torch.Tensor,
    key_base: int,
    keys: torch.Tensor,
    ages: torch.Tensor,
    clock: torch.Tensor,
    where: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    counts: torch.Tensor,
    cpu_counts: torch.Tensor | None = None,
    gpu_rows: torch.Tensor | None = None,
) -> None:
    """Least-recently-used cache slots for one token's distinct chosen experts `ids` [k] of one layer (key =
    key_base + expert), by the rule of engine/kernels/slot_table.py, updating the slot table in place: keys [S]
    (int32, -1 free), ages [S] (int32 last-use tick, -1 free), clock [1] (the last tick) and the reverse index
    where [keys' range] (int32 slot of each key, -1 for none), which each placement updates. Each miss that takes
    a slot gets a row (expert, slot) of the copy table [k, 2], whose other rows are -1. slots [k] receives every
    expert's slot; counts [2] (int64) adds (hits, misses that took a slot).
    With cpu_counts [k + 1] (int32: of m misses, how many the CPU computes), the last cpu_counts[m] misses take
    no slot (slot 0, no copy, the table unchanged, not counted) and gpu_rows [k] (float32) is 0 for them, 1 for
    the rest."""
    host = [t.cpu() for t in (keys, ages, clock)]  # the table itself when it lives on the host
    split = cpu_counts.tolist() if cpu_counts is not None else None
    chosen = [key_base + int(e) for e in ids.tolist()]
    held = host[0].tolist()  # each slot's key, as the call's placements change it
    found, misses = SlotTable(*host).lookup(chosen, (lambda m: m - split[m]) if split is not None else None)
    for tensor, on_host in zip((keys, ages, clock), host):
        if tensor is not on_host:
            tensor.copy_(on_host)
    for j in misses:
        slot = found[j]
        if slot is not None:  # the evicted key leaves the index, the placed one enters it
            if held[slot] >= 0:
                where[held[slot]] = -1
            where[chosen[j]], held[slot] = slot, chosen[j]
    slots.copy_(torch.tensor([0 if slot is None else slot for slot in found], dtype=slots.dtype))
    rows = [
        [key - key_base, slot] if j in misses and slot is not None else [-1, -1]
        for j, (key, slot) in enumerate(zip(chosen, found))
    ]
    table.copy_(torch.tensor(rows, dtype=table.dtype))
    if gpu_rows is not None:
        gpu_rows.copy_(torch.tensor([0.0 if slot is None else 1.0 for slot in found]))
    counts[0] += len(chosen) - len(misses)
    counts[1] += sum(found[j] is not None for j in misses)


def post_cpu_share(
    ids: torch.Tensor,
    weights: torch.Tensor,
    gpu_rows: torch.Tensor,
    y: torch.Tensor,
    sequence_base: torch.Tensor,
    ordinal: int,
    mailbox,
) -> None:
    """One token's experts that the CPU computes (gpu_rows 0; the others' ids go as -1), the routing weights and
    the input y [1, H] to the mailbox (engine/kernels/cpu_share.py), then its request set to the layer's sequence
    number, sequence_base [1] + ordinal."""
    on_cpu = gpu_rows.reshape(-1) == 0
    mailbox.ids.copy_(torch.where(on_cpu, ids.reshape(-1).to(torch.int32), -1))
    mailbox.weights.copy_(weights.reshape(-1))
    if on_cpu.any():
        mailbox.x.copy_(y.reshape(-1))
    mailbox.flags[0] = int(sequence_base[0]) + ordinal


def wait_cpu_share(
    gpu_rows: torch.Tensor,
    sequence_base: torch.Tensor,
    ordinal: int,
    mailbox,
    cpu_routed: torch.Tensor,
    waits: torch.Tensor,
    timeout: float = 60.0,
) -> None:
    """Wait until the mailbox's done flag reaches the layer's sequence number (or cancel is set), then the CPU's
    weighted sum into cpu_routed [1, H] (zeros when the CPU had no expert of this layer). waits [2] (int32)
    counts, of the layers with CPU experts, those where the CPU was not done yet, and all of them."""
    sequence = int(sequence_base[0]) + ordinal
    flags = mailbox.flags.numpy()
    deadline = time.monotonic() + timeout
    polls = 0
    while flags[1] < sequence and flags[2] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the CPU's experts of a decode step did not finish within {timeout:.0f} s")
        time.sleep(0)
        polls += 1
    any_cpu = bool((gpu_rows == 0).any())
    waits[0] += int(any_cpu and polls > 0)
    waits[1] += int(any_cpu)
    if any_cpu:
        cpu_routed.copy_(mailbox.out.reshape(cpu_routed.shape))
    else:
        cpu_routed.zero_()


def combine_experts(
    h: torch.Tensor,
    routed: torch.Tensor,
    weights: torch.Tensor,
    gpu_rows: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    cpu_routed: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token's MoE layer output plus its residual, in float32, returned in h's dtype: h [1, H] + shared
    [1, H] (times sigmoid(shared_gate [1, 1]) in shared's dtype, as the prompt path computes it) + the sum of
    routed [k, H] rows times weights [k] + cpu_routed [1, H]. Rows whose gpu_rows [k] is 0 (the CPU's: they read
    any slot) count for nothing, even as NaN; shared, its gate and cpu_routed may be absent."""
    weight = weights.reshape(-1, 1).float()
    if gpu_rows is not None:
        weight = torch.where(gpu_rows.reshape(-1, 1) > 0, weight, 0.0)
    total = h.float() + torch.where(weight != 0, routed.float() * weight, 0.0).sum(0, keepdim=True)
    if shared is not None and shared_gate is not None:
        shared = torch.sigmoid(shared_gate.reshape(1, 1)) * shared
    for extra in (shared, cpu_routed):
        if extra is not None:
            total = total + extra.float()
    return total.to(h.dtype)


def gather_records(records: torch.Tensor, pool: torch.Tensor, table: torch.Tensor) -> None:
    """pool[table[r, 1]] = records[table[r, 0]] for each row r of table [n, 2] whose source is not -1."""
    for source, target in table.tolist():
        if source >= 0:
            pool[target].copy_(records[source])


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [1, Hq, D] of the token at `position` (int tensor [1]), whose key and value are already in rows
    0..position of the caches keys [capacity, Hkv, D] and values [capacity, Hkv, Dv]; [1, Hq, Dv]. With
    kv_scales, the caches hold e4m3 bytes (fp8_causal_attention)."""
    length = int(position.reshape(-1)[0]) + 1
    if kv_scales is not None:
        return fp8_causal_attention(q, keys[:length], values[:length], scale, kv_scales)
    return causal_attention(q, keys[:length], values[:length], scale)


def dequantize_e4m3(rows: torch.Tensor, head_scales: torch.Tensor) -> torch.Tensor:
    """Float32 values of KV rows [N, Hkv, D] stored as e4m3 bytes (uint8), times their KV head's scale [Hkv]."""
    return rows.view(torch.float8_e4m3fn).float() * head_scales[:, None]


def fp8_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kv_scales: torch.Tensor
) -> torch.Tensor:
    """causal_attention's contract over an FP8 cache: k [S, Hkv, D] and v [S, Hkv, Dv] are e4m3 bytes (uint8),
    kv_scales [2, Hkv] float32 their keys' and values' scales per KV head. Computes in float32 in query x key
    blocks with an online softmax, dequantising one block of keys and values at a time; [T, Hq, Dv] in q's dtype."""
    new, heads, dim = q.shape
    total, kv_heads, value_dim = k.shape[0], k.shape[1], v.shape[2]
    groups = heads // kv_heads
    out = q.new_empty(new, heads, value_dim)
    for q_start in range(0, new, ATTENTION_QUERY_BLOCK):
        rows = min(ATTENTION_QUERY_BLOCK, new - q_start)
        query = q[q_start : q_start + rows].float().view(rows, kv_heads, groups, dim)
        first = total - new + q_start  # the block's first query's position
        query_pos = torch.arange(first, first + rows, device=q.device)
        m = torch.full((rows, kv_heads, groups), float("-inf"), device=q.device)
        total_weight = torch.zeros_like(m)
        acc = torch.zeros(rows, kv_heads, groups, value_dim, device=q.device)
        for k_start in range(0, first + rows, ATTENTION_KEY_BLOCK):  # the keys the block's last query sees
            keys = dequantize_e4m3(k[k_start : k_start + ATTENTION_KEY_BLOCK], kv_scales[0])
            values = dequantize_e4m3(v[k_start : k_start + ATTENTION_KEY_BLOCK], kv_scales[1])
            scores = torch.einsum("nhgd,bhd->nhgb", query, keys) * scale
            key_pos = torch.arange(k_start, k_start + keys.shape[0], device=q.device)
            scores = scores.masked_fill((key_pos[None, :] > query_pos[:, None])[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))  # finite: key 0, in the first block, is seen by all
            p = torch.exp(scores - m_new[..., None])
            alpha = torch.exp(m - m_new)
            total_weight = total_weight * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("nhgb,bhd->nhgd", p, values)
            m = m_new
        out[q_start : q_start + rows] = (acc / total_weight[..., None]).reshape(rows, heads, value_dim).to(q.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] are the last T positions of k, v [S, Hkv, D]; grouped-query; returns [T, Hq, D]."""
    new, total = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)).float() * scale  # [H, T, S]
    query_pos = torch.arange(total - new, total, device=q.device)[:, None]
    key_pos = torch.arange(total, device=q.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return (probs @ v).transpose(0, 1)
