"""Top-p (nucleus) thresholds without sorting the vocabulary: a radix select on mass.

Layouts: ``probs [N, V]`` fp32 (rows sum to 1, last dim contiguous), ``top_p [N]`` fp32 ->
``tau [N]`` fp32. A row keeps the tokens with ``probs >= tau``: the smallest set of the
most likely tokens whose mass reaches ``top_p``, plus any token tied with its least likely
member. ``tau`` is the largest value ``v`` with ``mass(probs >= v) >= top_p``; rows with
``top_p >= 1`` get 0 (every token kept) and read nothing.

A sort of every row (values and int64 indices), its cumulative sum and a scatter back
cost 4.3 ms a step at 256 rows of 128,256 on an H100 (r98). Here ``tau``'s bits are found
a few at a time, from the top: non-negative fp32 values order as their bit patterns do,
so each pass sums the row's mass by the next ``DIGIT_BITS`` bits among the values that
match the bits fixed so far, and keeps the largest digit whose mass, with everything
above it, still reaches ``top_p``. Probabilities are below 2, so their top two bits are 0
and 30 bits are left: ``ceil(30 / DIGIT_BITS)`` passes. A pass is a launch of a program
per ``CHUNK`` of each row, so a row is read by many SMs at once (one program per row was
latency-bound: ~0.7 ms a row on an H100, r99b); the next launch's programs each sum the
chunks' masses to take the pass's digit, and a last launch stores ``tau``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DIGIT_BITS = 3  # bits of tau fixed per pass over the row (30 / 3 = 10 passes)
# fewer bits make more passes (and launches), more bits more sums per element and pass
DIGIT_WIDTHS = (2, 3, 4, 5)
CHUNK = 4096  # elements of a row per program and pass
# fewer rows sort: one sort beats eleven short launches at 1 row, not at 8 (r99c, an H100:
# top-p 0.491 against 0.642 ms at 1 row, 0.682 against 0.605 at 8)
MIN_ROWS = 8
LANES = 8192  # BLOCK x 2**DIGIT_BITS per-lane sums a program holds (32 registers a thread)


def block_for(digit_bits: int) -> int:
    """Elements of a row per loop iteration at ``digit_bits``: at most 1,024."""
    return min(1024, LANES >> digit_bits)


def warps_for(digit_bits: int) -> int:
    """Warps a program: four elements a thread at most (16-byte loads), four warps at most
    (eight at 1,024 x 8 sums spill registers)."""
    return max(1, min(4, block_for(digit_bits) // 128))


def passes_for(digit_bits: int) -> int:
    """Passes over a row: probabilities' 30 low bits, ``digit_bits`` at a time."""
    return -(-30 // digit_bits)


# the row count varies by step: specialized on it (divisible by 16 or not) a server would
# compile every launch again, mid-serving, the first time a step's rows are not
@triton.jit(do_not_specialize=["num_rows"])
def _top_p_pass_kernel(
    probs_ptr,
    top_p_ptr,
    masses_ptr,
    prefix_ptr,
    above_ptr,
    vocab,
    stride,
    num_rows,
    num_chunks,
    PASS: tl.constexpr,
    PASSES: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """Launch ``PASS`` of ``PASSES + 1``, program (row, chunk): every program of a row
    first takes the previous pass's digit from its masses (all programs reach the same one
    from the same sums; chunk 0 records it), then sums its chunk's mass by the next digit
    among the values in the prefix. The last launch (one program a row) stores tau."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    # top_p 0 keeps the most likely token (and its ties), as a tiny top_p does
    p = tl.maximum(tl.load(top_p_ptr + row), 1e-30)
    NUM_DIGITS: tl.constexpr = 1 << DIGIT_BITS
    digits = tl.arange(0, NUM_DIGITS)
    prefix = tl.zeros([], dtype=tl.int32)  # tau's bits fixed so far, right-aligned
    above = tl.zeros([], dtype=tl.float32)  # mass of the values above the prefix
    if PASS > 0:
        if PASS > 1:
            prefix = tl.load(prefix_ptr + (PASS - 1) * num_rows + row)
            above = tl.load(above_ptr + (PASS - 1) * num_rows + row)
        chunks = tl.arange(0, CHUNKS_PAD)
        at = ((PASS - 1) % 2 * num_rows + row) * num_chunks * NUM_DIGITS
        m = tl.load(
            masses_ptr + at + chunks[:, None] * NUM_DIGITS + digits[None, :],
            mask=(chunks < num_chunks)[:, None],
            other=0.0,
        )
        mass = tl.sum(m, 0)  # [NUM_DIGITS]: the previous pass's, over the row
        # mass at or above each digit; the largest digit that still reaches top_p
        at_or_above = tl.sum(tl.where(digits[None, :] >= digits[:, None], mass[None, :], 0.0), 1)
        d = tl.max(tl.where(above + at_or_above >= p, digits, 0), 0)
        above += tl.sum(tl.where(digits > d, mass, 0.0), 0)
        prefix = (prefix << DIGIT_BITS) | d
        first = c == 0
        tl.store(prefix_ptr + PASS * num_rows + row, prefix, mask=first)
        tl.store(above_ptr + PASS * num_rows + row, above, mask=first)
    if PASS < PASSES:
        shift = DIGIT_BITS * (PASSES - 1 - PASS)
        begin = c * CHUNK
        end = tl.where(p < 1.0, tl.minimum(begin + CHUNK, vocab), begin)  # top_p 1: nothing
        base = probs_ptr + row * stride
        # per-lane sums through the loop, reduced once after it
        lanes = tl.zeros([NUM_DIGITS, BLOCK], dtype=tl.float32)
        for start in range(begin, end, BLOCK):
            # [1, BLOCK]: loaded in the layout the sums use (a 1-D load took a trip through
            # shared memory, with barriers, every iteration)
            offs = start + tl.arange(0, BLOCK)[None, :]
            live = offs < end
            x = tl.load(base + offs, mask=live, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            if PASS > 0:
                live = live & ((bits >> (shift + DIGIT_BITS)) == prefix)
            digit = (bits >> shift) & (NUM_DIGITS - 1)
            w = tl.where(live, x, 0.0)
            lanes += tl.where(digits[:, None] == digit, w, 0.0)
        at = ((PASS % 2) * num_rows + row) * num_chunks * NUM_DIGITS + c * NUM_DIGITS
        tl.store(masses_ptr + at + digits, tl.sum(lanes, 1))


def top_p_threshold(
    probs: torch.Tensor,
    top_p: torch.Tensor,
    digit_bits: int = DIGIT_BITS,
    min_rows: int = MIN_ROWS,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Each row's nucleus threshold ``tau [N]`` fp32 (see module doc); ``digit_bits``:
    bits fixed per pass, one of ``DIGIT_WIDTHS``; below ``min_rows`` rows the reference's
    sort instead (the same threshold); ``chunk``: elements of a row per program, a power
    of two of at least one loop iteration's."""
    _check(probs, top_p)
    if digit_bits not in DIGIT_WIDTHS:
        raise ValueError(
            f"top_p_threshold: digit_bits must be one of {DIGIT_WIDTHS}, got {digit_bits}"
        )
    block = block_for(digit_bits)
    if chunk < block or chunk & (chunk - 1):
        raise ValueError(f"top_p_threshold: chunk must be a power of two >= {block}, got {chunk}")
    n, vocab = probs.shape
    if n < min_rows:
        return top_p_threshold_ref(probs, top_p)
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=probs.device)
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    top_p = top_p.contiguous()
    passes = passes_for(digit_bits)
    num_chunks = triton.cdiv(vocab, chunk)
    dev = probs.device
    masses = torch.empty(2, n, num_chunks, 1 << digit_bits, dtype=torch.float32, device=dev)
    prefix = torch.empty(passes + 1, n, dtype=torch.int32, device=dev)  # after each pass
    above = torch.empty(passes + 1, n, dtype=torch.float32, device=dev)
    for i in range(passes + 1):
        _top_p_pass_kernel[(n, num_chunks if i < passes else 1)](
            probs,
            top_p,
            masses,
            prefix,
            above,
            vocab,
            probs.stride(0),
            n,
            num_chunks,
            PASS=i,
            PASSES=passes,
            DIGIT_BITS=digit_bits,
            CHUNK=chunk,
            BLOCK=block,
            CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)),
            num_warps=warps_for(digit_bits),
        )
    return prefix[passes].view(torch.float32)  # tau's bits


def top_p_threshold_ref(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: the value of the last token kept when each row, sorted, keeps tokens
    while the mass before them is below ``top_p``; 0 for rows with ``top_p >= 1``."""
    _check(probs, top_p)
    ordered = torch.sort(probs, dim=-1, descending=True).values
    before = torch.cumsum(ordered, dim=-1) - ordered
    kept = (before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    tau = ordered.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    return torch.where(top_p < 1.0, tau, 0.0)


def _check(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(
            f"top_p_threshold: probs must be [N, V] fp32, got {tuple(probs.shape)} {probs.dtype}"
        )
    if top_p.shape != probs.shape[:1] or top_p.dtype != torch.float32:
        raise ValueError(
            f"top_p_threshold: top_p must be [{probs.shape[0]}] fp32, got "
            f"{tuple(top_p.shape)} {top_p.dtype}"
        )
