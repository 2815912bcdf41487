"""Mutation check of the seed methods: each listed one-line mutation of a core comparison must make its tests fail.

    python scripts/mutants.py                  # every mutant
    python scripts/mutants.py --only kvmerger-theta-strict pod-shared-distant-only
    python scripts/mutants.py --method omnikv  # the mutants of one method
    python scripts/mutants.py --list           # what would run

For each mutant (file, exact original text, exact mutated text) the script checks that the original occurs exactly
once in its file, applies the mutation in a private copy of the working tree (the checkout itself is never
written), runs the fast tests that guard it there (``-m "not slow" -x``), and restores the copy's file in a
``finally`` (Ctrl-C and errors included). A mutant is *killed* when those tests fail (or run past ``--timeout``),
*survived* when they pass. Before the mutants, each distinct test selection runs once on the unmutated copy: a red
baseline would make every mutant look killed.

Exit status: 0 when every mutant was killed; 1 when any survived; 2 when the list is stale (an original text not
found exactly once) or the baseline fails.

An entry whose original text is no longer found exactly once is reported as stale (exit 2), not skipped: the list
follows the code (``tests/test_mutants_script.py`` checks it on every run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OMNIKV = ["tests/test_method_omnikv.py", "tests/test_parity_omnikv.py"]
KVMERGER = ["tests/test_method_kvmerger.py"]
POD = ["tests/test_method_pod.py"]
D2O = ["tests/test_method_d2o.py", "tests/test_parity_d2o.py"]
DYNAMICKV = ["tests/test_method_dynamickv.py", "tests/test_parity_dynamickv.py"]
PARITY = "tests/test_parity_kvfactory.py"
SNAPKV = ["tests/test_methods.py", PARITY, "-k", "not parity or snapkv"]
PYRAMIDKV = ["tests/test_methods.py", PARITY, "-k", "not parity or pyramidkv"]
H2O = ["tests/test_methods.py", PARITY, "-k", "not parity or h2o"]
STREAMINGLLM = ["tests/test_methods.py", PARITY, "-k", "not parity or streamingllm"]
CAM = ["tests/test_method_cam.py", PARITY, "-k", "not parity or cam"]
BATCH = ["tests/test_batch_equals_single.py", "-k", "snapkv or pyramidkv or h2o"]
SCORERS = ["tests/test_method_scorers.py", "tests/test_parity_kvpress.py"]
THINK = ["tests/test_parity_kvpress_think.py", "tests/test_parity_think_official.py"]
TOVA = [*SCORERS, "tests/test_parity_tova_official.py", "-k", "tova"]
RKV = ["tests/test_parity_rkv_official.py"]
TRI = ["tests/test_parity_triattention_official.py"]
ADAKV_OFFICIAL = ["tests/test_parity_adakv_official.py"]
KVZIP = ["tests/test_parity_kvpress_kvzip.py", "tests/test_parity_kvzip_official.py"]
RAGGED = ["tests/test_ragged_cache.py"]
EDGES = ["tests/test_decision_edges.py"]  # boundary tests of decision lines (issue #39 item 5)
KERNELS = ["tests/test_prefill_kernels.py", "tests/test_fused_column_sums.py", "tests/test_method_cam.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    method: str
    file: str
    original: str
    mutated: str
    tests: list[str] = field(default_factory=list)  # pytest arguments: test files, optionally "-k", "expr"
    what: str = ""


MUTANTS = [
    # ---- OmniKV (kvbench/methods/omnikv.py, omnikv_select.py) ------------------------------------------
    Mutant("omnikv-softmax-range", "omnikv", "kvbench/methods/omnikv_select.py",
           "probs = torch.softmax(_logits(rotated, keys[:, :, :consider], scaling), dim=-1).amax(dim=(1, 2))",
           "probs = torch.softmax(_logits(rotated, keys, scaling), dim=-1)[..., :consider].amax(dim=(1, 2))",
           OMNIKV, "official window: softmax over the whole prompt instead of the first n - p tokens"),
    Mutant("omnikv-window-rotation", "omnikv", "kvbench/methods/omnikv_select.py",
           "b, hq = recent.shape[:2]\n    delta = (positions[:, -1:] - positions)",
           "b, hq = recent.shape[:2]\n    delta = (positions - positions)",
           OMNIKV, "official window: queries left at their own positions"),
    Mutant("omnikv-reduced-k", "omnikv", "kvbench/methods/omnikv_select.py",
           "chosen = _top(scores, min(consider, max(1, k - prompt_rows)))",
           "chosen = _top(scores, min(consider, max(1, k)))",
           OMNIKV, "official window: top-k not reduced by the window's prompt rows"),
    Mutant("omnikv-last-max-heads", "omnikv", "kvbench/methods/omnikv_select.py",
           "return _top(logits.amax(dim=(1, 2)), k)",
           "return _top(logits.mean(dim=(1, 2)), k)",
           OMNIKV, "last: mean over query heads instead of max"),
    Mutant("omnikv-topk-largest", "omnikv", "kvbench/methods/omnikv_select.py",
           "return torch.topk(scores, k, dim=-1).indices.sort(-1).values",
           "return torch.topk(scores, k, dim=-1, largest=False).indices.sort(-1).values",
           OMNIKV, "selection: the k lowest scores"),
    Mutant("omnikv-module-scale", "omnikv", "kvbench/methods/omnikv.py",
           "scaling = ctx.scaling or keys.shape[-1] ** -0.5",
           "scaling = keys.shape[-1] ** -0.5",
           OMNIKV, "1/sqrt(d) instead of the module's scale"),
    Mutant("omnikv-wait-layers", "omnikv", "kvbench/methods/omnikv.py",
           "return None if layer_idx - source <= self.wait_layers else source",
           "return None if layer_idx - source < self.wait_layers else source",
           OMNIKV, "one wait layer fewer (layer roles, Mem%)"),
    # ---- KVMerger (kvbench/methods/kvmerger.py, kvmerger_ops.py) --------------------------------------
    Mutant("kvmerger-theta-strict", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "bad = np.nonzero(kn[a : i + 1] @ kn[j] <= theta)[0]",
           "bad = np.nonzero(kn[a : i + 1] @ kn[j] < theta)[0]",
           KVMERGER, "Algorithm 1: merge at cos >= theta instead of > theta"),
    Mutant("kvmerger-heavy-outside-recent", "kvmerger", "kvbench/methods/kvmerger.py",
           "older = a[row].view(g, h // g, n).mean(1)[:, pad : n - n_rec]",
           "older = a[row].view(g, h // g, n).mean(1)[:, pad:]",
           KVMERGER, "heavy hitters chosen among all tokens, recent ones included"),
    Mutant("kvmerger-pivot-argmax", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           'cand = torch.where(s == per_set(s, "amax")[seg]',
           'cand = torch.where(s == per_set(s, "amin")[seg]',
           KVMERGER, "pivot: the least attended member"),
    Mutant("kvmerger-gaussian-sign", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "g = torch.exp(-d2 / (2 * sig.clamp(min=_EPS)[seg] ** 2))",
           "g = torch.exp(d2 / (2 * sig.clamp(min=_EPS)[seg] ** 2))",
           KVMERGER, "Gaussian kernel weights growing with the distance"),
    Mutant("kvmerger-device-theta-strict", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "first = torch.searchsorted(floor, (-th)",
           "first = torch.searchsorted(floor, right=True, input=(-th)",
           KERNELS, "Algorithm 1 on the device (few_kernels): a lag at exactly theta ends no set"),
    Mutant("kvmerger-device-bisection-break", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "stop = accept & (count == room)  # the host's break",
           "stop = accept & (count == room + 1)  # the host's break",
           KERNELS, "theta bisection on the device: no early stop when the sets fill the room exactly"),
    Mutant("kvmerger-device-path-turn", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "child = 2 * torch.arange(k, device=dev) + 1 + accept.long()",
           "child = 2 * torch.arange(k, device=dev) + 2 - accept.long()",
           KERNELS, "theta bisection on the device, 8 steps per pass: the path turns the wrong way after a step"),
    # ---- constant-kernel prefill passes (few_kernels; engine/scores.py, cam_ops.py) ------------------------------
    Mutant("column-sums-lse-order", "h2o", "kvbench/engine/scores.py",
           "bias = -lse.flip(-1) / scaling",
           "bias = -lse / scaling",
           KERNELS, "fused column sums: each query's log-sum-exp paired with the wrong query"),
    Mutant("column-sums-bf16-split", "h2o", "kvbench/engine/scores.py",
           "kt[..., d + 1] = (bias - hi.float()).to(q.dtype)",
           "kt[..., d + 1] = 0",
           KERNELS, "fused column sums: the bias rounded to one bfloat16"),
    Mutant("cam-lambda-band", "cam", "kvbench/methods/cam_ops.py",
           "band = (t >= u) & (t <= u + r)",
           "band = (t >= u) & (t < u + r)",
           KERNELS, "Λ attention in blocks: the oldest token of the window masked"),
    Mutant("cam-lambda-sinks", "cam", "kvbench/methods/cam_ops.py",
           'win.masked_fill_(~(band & (key_pos >= s)), float("-inf"))',
           'win.masked_fill_(~band, float("-inf"))',
           KERNELS, "Λ attention in blocks: the start tokens counted twice (as sinks and in the window)"),
    Mutant("lminfinite-blocked-window", "lminfinite", "kvbench/methods/lminfinite.py",
           "kpos = blocks(pad(layer.positions, (span, tail)), 2)",
           "kpos = blocks(pad(layer.positions, (span - 1, tail + 1)), 2)",
           ["tests/test_method_lminfinite.py"], "blocked Λ attention: the keys' positions one entry off their keys"),
    Mutant("lminfinite-blocked-padding", "lminfinite", "kvbench/methods/lminfinite.py",
           "kok = blocks(pad(valid, (span, tail), value=False), 1)",
           "kok = blocks(pad(valid, (span, tail), value=True), 1)",
           ["tests/test_method_lminfinite.py"], "blocked Λ attention: the padding before the first block attended"),
    Mutant("lminfinite-loop-on-gpu", "lminfinite", "kvbench/methods/lminfinite.py",
           "        if ctx.few_kernels:\n            return _blocked(",
           "        if False:\n            return _blocked(",
           ["tests/test_prefill_kernels.py", "-k", "lminfinite"],
           "prefill: the chunk loop (kernels growing with the prompt) where the GPU's blocked form is asked for"),
    Mutant("pyramidinfer-chunks-on-gpu", "pyramidinfer", "kvbench/methods/pyramidinfer.py",
           "        if ctx.few_kernels:  # a launch-bound device",
           "        if False:  # a launch-bound device",
           ["tests/test_prefill_kernels.py", "-k", "pyramidinfer"],
           "masked prompt attention: passes of 512 queries (kernels growing with the prompt) where few are asked for"),
    # ---- POD (kvbench/methods/pod.py, pod_attention.py) -------------------------------------------------------
    Mutant("pod-shared-distant-only", "pod", "kvbench/methods/pod.py",
           'self._shared[ctx.layer_idx] = logits.masked_fill(~dist, float("-inf"))',
           'self._shared[ctx.layer_idx] = logits.masked_fill(~(prox | dist), float("-inf"))',
           POD, "decode: the shared distant logits cover every token, proximal ones included"),
    Mutant("pod-static-distant-edge", "pod", "kvbench/methods/pod.py",
           "distant = (valid & (slot >= n_s) & (slot <= newest - n_r))",
           "distant = (valid & (slot >= n_s) & (slot < newest - n_r))",
           ["tests/test_static_decode.py", "-k", "pod"],
           "captured decode: the oldest recent entry's logit is taken from the distant set"),
    Mutant("pod-static-no-pass-up", "pod", "kvbench/methods/pod.py",
           "shared.copy_(torch.where(lowest, logits.masked_fill(~distant, float(\"-inf\")), shared))",
           "shared.copy_(shared)",
           ["tests/test_static_decode.py", "-k", "pod"],
           "captured decode: the lowest layers do not pass their distant logits up"),
    Mutant("pod-static-ring-write", "pod", "kvbench/engine/static.py",
           "key_slot = torch.where(slot < sinks, slot, sinks + (slot - sinks) % recent)",
           "key_slot = torch.where(slot < sinks, slot, sinks + (slot - sinks + 1) % recent)",
           ["tests/test_static_decode.py", "-k", "pod"],
           "captured decode: the step's key overwrites a key still in the window"),
    Mutant("pod-static-ring-entry", "pod", "kvbench/methods/pod.py",
           "held = torch.where(ring < n_s, ring <= newest, entry >= n_s)",
           "held = torch.where(ring < n_s, ring <= newest, entry > n_s)",
           ["tests/test_static_decode.py", "-k", "pod"],
           "captured decode: a trimmed layer misses the first entry after the sinks"),
    Mutant("d2o-static-no-hand-back", "d2o", "kvbench/methods/d2o.py",
           "if tau is not None and not bool(torch.isnan(tau[-1]).all()):",
           "if False:",
           ["tests/test_static_decode.py", "-k", "carries"],
           "captured decode: carry_tau's thresholds stay in the static layers"),
    Mutant("d2o-static-reads-late", "d2o", "kvbench/engine/session.py",
           "return 1 if self.method.keeps_state_after_generation() and not self.budget.is_full else None",
           "return None",
           ["tests/test_static_decode.py", "-k", "carries"],
           "captured decode: carry_tau's generation runs steps past its end (their merges carried)"),
    Mutant("snapkv-must-keep-count", "snapkv", "kvbench/methods/snapkv.py",
           "return min(self.window, n)",
           "return min(self.window, n - 1)",
           ["tests/test_prefill_kernels.py", "-k", "declared"],
           "the declared must-keep count one short for a prompt within the window"),
    Mutant("ragged-flat-order", "adakv", "kvbench/engine/cache.py",
           "flat = torch.argsort((~kept.reshape(-1)).to(torch.int8), stable=True)[:total]",
           "flat = torch.argsort((~kept.reshape(-1)).to(torch.int8), stable=True)[1 : total + 1]",
           RAGGED, "ragged layout: the flat index shifted by one entry (the last one a dropped entry)"),
    Mutant("pod-split-decode", "pod", "kvbench/methods/pod_attention.py",
           "distant = (j >= n_s) & (j <= i - n_r)",
           "distant = (j >= n_s) & (j < i - n_r)",
           POD, "eq. 3 (decode and prompt share it): the recent window one token longer"),
    Mutant("pod-split-prefill", "pod", "kvbench/methods/pod_attention.py",
           "distant = (j >= n_s) & (j <= i - n_r)",
           "distant = (j > n_s) & (j <= i - n_r)",
           POD, "eq. 3 (decode and prompt share it): one sink more"),
    Mutant("pod-gate", "pod", "kvbench/methods/pod_attention.py",
           "gate = torch.exp(lse_p - torch.logaddexp(lse_p, lse_d))",
           "gate = torch.exp(lse_d - torch.logaddexp(lse_p, lse_d))",
           POD, "eq. 4: the gate weighs the distant part with the proximal mass"),
    # ---- SnapKV (kvbench/methods/snapkv.py; its selection in scorer.py, keep_top in cache_ops.py) ----------------
    Mutant("snapkv-score-last-query", "snapkv", "kvbench/methods/snapkv.py",
           "votes = probs[..., : n - window].sum(-2)  # (B, Hq, n - w)",
           "votes = probs[..., -1, : n - window]  # (B, Hq, n - w)",
           SNAPKV, "score: the last query's attention instead of the window's sum"),
    Mutant("snapkv-no-pooling", "snapkv", "kvbench/methods/snapkv.py",
           "votes = aggregate_group(pool1d(votes, kernel, pooling), heads, group_agg)  # (B, H, n - w)",
           "votes = aggregate_group(votes, heads, group_agg)  # (B, H, n - w)",
           SNAPKV, "pooling: none (kernel 1)"),
    Mutant("snapkv-group-max", "snapkv", "kvbench/methods/snapkv.py",
           "votes = aggregate_group(votes, heads, group_agg.removesuffix(\"_before_pool\"))",
           "votes = aggregate_group(votes, heads, \"max\")",
           SNAPKV, "group aggregation: the reference's kv_head mode takes the group's max, not its mean"),
    Mutant("snapkv-window-protection", "snapkv", "kvbench/methods/scorer.py",
           "keep_top(layer, scores, self.layer_capacity(ctx), window=window)",
           "keep_top(layer, scores, self.layer_capacity(ctx))",
           SNAPKV, "selection: top C over every token with the window at +inf (ties broken otherwise)"),
    Mutant("scorer-short-prompt-is-window", "snapkv", "kvbench/methods/scorer.py",
           "if ctx.n <= window or ctx.fits():",
           "if ctx.fits():",
           ["tests/test_scorer_method.py"], "selection: a prompt no longer than the window selected, not kept whole"),
    Mutant("scorer-group-mean", "snapkv", "kvbench/methods/scorer.py",
           '        return "mean"',
           '        return "max"',
           ["tests/test_scorer_method.py"], "GQA: per-query-head scores reduced by the group's max, not its mean"),
    Mutant("keep-top-row-order", "snapkv", "kvbench/methods/cache_ops.py",
           "entries = torch.sort((~valid[row, hidx]).to(torch.uint8), dim=-1, stable=True).indices[:, :m]",
           "entries = torch.sort((~valid[row, hidx]).to(torch.uint8), dim=-1, stable=True).indices[:, :m].flip(-1)",
           BATCH, "batch: a padded row's entries selected in another order than the row alone (ties differ)"),
    # ---- PyramidKV (kvbench/methods/pyramidkv.py) ---------------------------------------------------------------
    Mutant("pyramidkv-min-real", "pyramidkv", "kvbench/methods/pyramidkv.py",
           "low = int(base // beta)",
           "low = int(round(base / beta))",
           PYRAMIDKV, "capacity arithmetic: min rounded instead of the code's floor division"),
    Mutant("pyramidkv-step-divisor", "pyramidkv", "kvbench/methods/pyramidkv.py",
           'STEP_DIVISOR = {"kvfactory_2406": 0, "kvfactory_2409": 1}',
           'STEP_DIVISOR = {"kvfactory_2406": 1, "kvfactory_2409": 0}',
           PYRAMIDKV, "capacity arithmetic: the two periods' step divisors swapped"),
    Mutant("pyramidkv-clamp", "pyramidkv", "kvbench/methods/pyramidkv.py",
           "            high = n - window\n            low = 2 * base - high\n        steps",
           "            high = n - window - 1\n            low = 2 * base - high\n        steps",
           PYRAMIDKV, "capacity arithmetic: max clamped to n - w - 1 (the 2024-06-10 file) instead of n - w"),
    # ---- H2O (kvbench/methods/h2o.py, engine/scores.py) -------------------------------------------------------------
    Mutant("h2o-2410-causal", "h2o", "kvbench/engine/scores.py",
           "future = (k_idx > q_idx) & (q_idx >= n - window) & (k_idx >= n - window)",
           "future = k_idx > q_idx",
           H2O, "score (kvfactory_2410): fully causal instead of the reference's w x w block mask"),
    Mutant("h2o-2406-score", "h2o", "kvbench/methods/h2o.py",
           "return window_attention(ctx.queries, layer.keys, self.window, ctx.scaling, ctx.key_valid).sum(-2)",
           "return window_attention(ctx.queries, layer.keys, self.window, ctx.scaling, ctx.key_valid).amax(-2)",
           H2O, "score (kvfactory_2406): the window's max instead of its sum"),
    Mutant("h2o-group-max", "h2o", "kvbench/methods/h2o.py",
           "return aggregate_group(self._prompt_scores(layer, ctx), layer.keys.shape[1], self.group_agg)",
           "return aggregate_group(self._prompt_scores(layer, ctx), layer.keys.shape[1], \"max\")",
           H2O, "group aggregation: max over the group instead of group_agg"),
    Mutant("h2o-window", "h2o", "kvbench/methods/h2o.py",
           "return torch.full_like(capacity, self.window)",
           "return torch.full_like(capacity, self.window - 1)",
           H2O, "window protection: one protected token fewer"),
    # ---- StreamingLLM (kvbench/methods/streamingllm.py) -------------------------------------------------------------
    Mutant("streamingllm-kvfactory-head", "streamingllm", "kvbench/methods/streamingllm.py",
           "head = self.sink_size if self.variant == \"paper\" or self.window is None else cap - self.window",
           "head = self.sink_size if self.variant == \"paper\" else cap - (self.window or 0)",
           STREAMINGLLM, "window protection: window=null keeps the first C tokens, not 4 sinks + C - 4 recent"),
    Mutant("streamingllm-recent", "streamingllm", "kvbench/methods/streamingllm.py",
           "keep = ((rank >= 0) & (rank < head)) | (rank >= count - recent)",
           "keep = ((rank >= 0) & (rank < head)) | (rank > count - recent)",
           STREAMINGLLM, "window protection: one recent token fewer"),
    # ---- CaM prefill_only (kvbench/methods/cam.py) ------------------------------------------------------------------
    Mutant("cam-group-max", "cam", "kvbench/methods/cam.py",
           "votes = aggregate_group(votes, hkv, \"mean\")",
           "votes = aggregate_group(votes, hkv, \"max\")",
           CAM, "group aggregation: max over the group instead of the mean"),
    Mutant("cam-window", "cam", "kvbench/methods/cam.py",
           "torch.cat([votes[..., : n - w], torch.full_like(votes[..., n - w :],",
           "torch.cat([votes[..., : n - w - 1], torch.full_like(votes[..., n - w - 1 :],",
           CAM, "score: the newest past token scored as the window"),
    # ---- D2O (kvbench/methods/d2o.py, d2o_ops.py) --------------------------------------------------------------
    Mutant("d2o-minmax-density", "d2o", "kvbench/methods/d2o_ops.py",
           "out.append(((var - var.min())",
           "out.append(((var + var.min())",
           D2O, "official density: min-max normalisation of the per-head variance"),
    Mutant("d2o-allocation-sign", "d2o", "kvbench/methods/d2o_ops.py",
           "weights = torch.softmax(-density.float(), dim=0)",
           "weights = torch.softmax(density.float(), dim=0)",
           D2O, "official allocation: more tokens to denser layers"),
    Mutant("d2o-allocation-literal", "d2o", "kvbench/methods/d2o_ops.py",
           "weights = torch.softmax(-normalise_density(density, how)",
           "weights = torch.softmax(normalise_density(density, how)",
           D2O, "paper/zscore allocation: more tokens to denser layers"),
    Mutant("d2o-merge-slot", "d2o", "kvbench/methods/d2o_ops.py",
           "merge = slot >= new.unsqueeze(-1)",
           "merge = slot <= new.unsqueeze(-1)",
           D2O, "merge only the evicted slots"),
    Mutant("d2o-ema", "d2o", "kvbench/methods/d2o_ops.py",
           "(1 - beta) * old + beta * m_bar",
           "(1 + beta) * old + beta * m_bar",
           D2O, "EMA threshold update"),
    Mutant("d2o-ema-gate", "d2o", "kvbench/methods/d2o_ops.py",
           "merge = m.double() >= torch.where(fresh, mean_m, tau).unsqueeze(-1)",
           "merge = m.double() <= torch.where(fresh, mean_m, tau).unsqueeze(-1)",
           D2O, "EMA gate: merge when the similarity reaches the threshold"),
    Mutant("d2o-self-weight", "d2o", "kvbench/methods/d2o_ops.py",
           "return 1.0, m * flag, flag",
           "return 2.0, m * flag, flag",
           D2O, "merge weights: the kept token's own weight"),
    Mutant("d2o-merge-denominator", "d2o", "kvbench/methods/d2o_ops.py",
           "merged = (self_w * xf + num) / (self_w + den).unsqueeze(-1)",
           "merged = (self_w * xf + num) / (self_w - den).unsqueeze(-1)",
           D2O, "merge weights normalised"),
    Mutant("d2o-recent-window", "d2o", "kvbench/methods/d2o.py",
           "(rank >= (counts - recent.view(-1, 1)).unsqueeze(-1))",
           "(rank > (counts - recent.view(-1, 1)).unsqueeze(-1))",
           D2O, "the recent window's size"),
    Mutant("d2o-edge-layers", "d2o", "kvbench/methods/d2o.py",
           "layer in (0, 1, num_layers - 1)",
           "layer in (0, 1, num_layers - 2)",
           D2O, "official code: the layers never compressed"),
    Mutant("d2o-first-token", "d2o", "kvbench/methods/d2o.py",
           "official_ratios(density, capacity / n), n + 1,",
           "official_ratios(density, capacity / n), n + 2,",
           D2O, "official code: layers sized at the first generated token"),
    # ---- DynamicKV (kvbench/methods/dynamickv.py) ------------------------------------------------------------
    Mutant("dynamickv-schedule", "dynamickv", "kvbench/methods/dynamickv.py",
           "if ctx.layer_idx % self.update_interval == self.update_interval - 1 and (",
           "if ctx.layer_idx % self.update_interval == self.update_interval - 2 and (",
           DYNAMICKV, "official schedule: re-allocation every m-th layer"),
    Mutant("dynamickv-schedule-switch", "dynamickv", "kvbench/methods/dynamickv.py",
           "if self.schedule == \"paper\":",
           "if self.schedule != \"paper\":",
           DYNAMICKV, "paper vs official schedule"),
    Mutant("dynamickv-target", "dynamickv", "kvbench/methods/dynamickv_ops.py",
           "target, s = base * num_layers, sum(z)",
           "target, s = base + num_layers, sum(z)",
           DYNAMICKV, "eq. 8: the total budget"),
    Mutant("dynamickv-ratio", "dynamickv", "kvbench/methods/dynamickv_ops.py",
           "ratio = sum(z) / target",
           "ratio = sum(z) * target",
           DYNAMICKV, "eq. 8: the rescaling ratio"),
    Mutant("dynamickv-head-index", "dynamickv", "kvbench/methods/dynamickv_ops.py",
           "top // (h * past)",
           "top % (h * past)",
           DYNAMICKV, "eq. 5: layer of a top entry"),
    Mutant("dynamickv-remainder", "dynamickv", "kvbench/methods/dynamickv.py",
           "counts[-1] += base * self._scores[0].shape[1] - sum(counts)",
           "counts[0] += base * self._scores[0].shape[1] - sum(counts)",
           DYNAMICKV, "eq. 8: the rounding remainder to the last layer"),
    Mutant("dynamickv-score-order", "dynamickv", "kvbench/methods/dynamickv.py",
           "layer.gather(torch.sort(key, dim=-1, descending=True, stable=True)",
           "layer.gather(torch.sort(-key.abs(), dim=-1, descending=True, stable=True)",
           DYNAMICKV, "the temporary cache in the code's score order: a re-allocation keeps its prefix"),
    Mutant("dynamickv-held", "dynamickv", "kvbench/methods/dynamickv.py",
           "                self._held[i] = keep\n",
           "",
           DYNAMICKV, "water-fill caps: what each layer holds after the last re-allocation"),
    Mutant("dynamickv-window-sum", "dynamickv", "kvbench/methods/dynamickv_ops.py",
           "return probs[..., : n - ws].sum(-2)",
           "return probs[..., : n - ws].sum(-1)",
           DYNAMICKV, "eq. 4: the window's attention summed over its queries"),
    # ---- the scorers and the wrappers over them (issue #27) ------------------------------------------------------
    Mutant("knorm-largest-norm", "knorm", "kvbench/methods/knorm.py",
           "scores = -torch.linalg.vector_norm(keys, dim=-1, dtype=dtype)",
           "scores = torch.linalg.vector_norm(keys, dim=-1, dtype=dtype)",
           [*SCORERS, "-k", "knorm"], "score: keep the largest key norms"),
    Mutant("keydiff-anchor-unnormalised", "keydiff", "kvbench/methods/keydiff.py",
           "anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)",
           "anchor = keys.mean(dim=-2, keepdim=True)",
           [*SCORERS, "-k", "keydiff"], "anchor: the mean key instead of the mean key direction"),
    Mutant("keydiff-block-anchor-unnormalised", "keydiff", "kvbench/methods/keydiff.py",
           "unit = keys / norms.clamp_min(1e-12)  # F.normalize",
           "unit = keys",
           [*SCORERS, "-k", "keydiff"], "block mode's anchor: the mean key instead of the mean key direction"),
    Mutant("tova-decode-max-heads", "tova", "kvbench/methods/tova.py",
           "scores = ctx.probs[:, :, :, -1].mean((1, 2))",
           "scores = ctx.probs[:, :, :, -1].amax((1, 2))",
           TOVA, "decode: the heads' maximum attention instead of their average"),
    Mutant("tova-prefill-second-to-last-query", "tova", "kvbench/methods/tova.py",
           "probs = window_attention(queries, keys, 1, scaling, key_valid)[:, :, 0]",
           "probs = window_attention(queries, keys, 2, scaling, key_valid)[:, :, 0]",
           TOVA, "prefill: the second-to-last prompt query's attention instead of the last's"),
    Mutant("expected-attention-covariance-scale", "expected_attention", "kvbench/methods/expected_attention.py",
           "* (scaling * scaling / 2)",
           "* (scaling / 2)",
           [*SCORERS, "-k", "expected_attention"], "expected logit: the covariance term scaled by s/2, not s^2/2"),
    Mutant("keydiff-block-lowest", "keydiff", "kvbench/methods/keydiff.py",
           "kept = torch.gather(cand, -1, scores.topk(keep, dim=-1).indices)",
           "kept = torch.gather(cand, -1, scores.topk(keep, dim=-1, largest=False).indices)",
           [*SCORERS, "-k", "keydiff"], "block-wise selection: each block keeps the least distinctive keys"),
    Mutant("tova-kvpress-first-token", "tova", "kvbench/methods/tova.py",
           'scores[..., -1] = float("inf")',
           'scores[..., 0] = float("inf")',
           TOVA, "kvpress reading's safeguard: the first prompt token kept instead of the last"),
    Mutant("rkv-group-mean", "rkv", "kvbench/methods/rkv.py",
           ".amax(2) * scaling",
           ".mean(2) * scaling",
           RKV, "GQA: the mean of the group's logits instead of their max (compute_attention_scores pooling)"),
    Mutant("rkv-softmax-over-window", "rkv", "kvbench/methods/rkv.py",
           "probs = torch.softmax(past, dim=-1)",
           "probs = torch.softmax(logits, dim=-1)[..., : n - window]",
           RKV, "importance: the softmax over every key, the window's included, instead of the older keys alone"),
    Mutant("rkv-no-pooling", "rkv", "kvbench/methods/rkv.py",
           'return pool1d(attn, kernel, "max")',
           "return attn",
           RKV, "importance: no max-pooling over positions"),
    Mutant("rkv-retain-first", "rkv", "kvbench/methods/rkv.py",
           "index = torch.where(similar, local, zero).amax(-1)",
           "index = torch.where(similar, local, zero).amin(-1)",
           RKV, "redundancy: retain_direction=last zeroes the first similar key's entry"),
    Mutant("rkv-padded-rows-counted", "rkv", "kvbench/methods/rkv.py",
           "sim = sim.masked_fill(~row_valid, 0.0)",
           "sim = sim",
           RKV, "redundancy: a left-padded row's padding keys add to every column's similarity"),
    Mutant("rkv-lambda-swapped", "rkv", "kvbench/methods/rkv.py",
           "scores = attn * self.mix_lambda - redundancy * (1 - self.mix_lambda)",
           "scores = attn * (1 - self.mix_lambda) - redundancy * self.mix_lambda",
           RKV, "mix: lambda weighs the redundancy instead of the importance"),
    Mutant("rkv-keys-counted-by-queries", "rkv", "kvbench/methods/rkv.py",
           "w, n = self.window, layer.keys.shape[2]",
           "w, n = self.window, ctx.n",
           RKV, "decode-time scoring: the cache's length read from the query buffer's"),
    Mutant("rkv-cache-position-order", "rkv", "kvbench/methods/rkv.py",
           "return torch.argsort(key, dim=-1, stable=True)",
           "return None",
           RKV, "decode-time compressions score the cache in position order, not in the code's stored order"),
    Mutant("triattention-no-rope-inversion", "triattention", "kvbench/methods/triattention.py",
           "k = rotate_keys(keys.float(), -positions.float(), inv_freq.float())",
           "k = keys.float()",
           TRI, "score: the post-RoPE keys scored as they are, not un-rotated at their positions"),
    Mutant("triattention-mlr-off", "triattention", "kvbench/methods/triattention.py",
           "extra = (q_abs_mean if disable_mlr else q_abs_mean - q_mean_abs).unsqueeze(1) * k_abs",
           "extra = q_abs_mean.unsqueeze(1) * k_abs",
           TRI, "score: the position-free term E|q| |k| instead of (E|q| - |E q|) |k| (the code's disable_mlr)"),
    Mutant("triattention-no-normalisation", "triattention", "kvbench/methods/triattention.py",
           "matrix = (matrix - mean) / std",
           "matrix = matrix - mean",
           TRI, "selection: each sampled head's scores centred but not divided by their std"),
    Mutant("triattention-layer-max", "triattention", "kvbench/methods/triattention.py",
           "aggregated = torch.stack(per_layer).mean(0) if per_layer else matrix.mean(0)",
           "aggregated = torch.stack(per_layer).amax(0) if per_layer else matrix.mean(0)",
           TRI, "selection: the max over layers instead of the mean of the layers' group maxima"),
    Mutant("triattention-trigger-at-budget", "triattention", "kvbench/methods/triattention.py",
           "return size >= self._budget + self.divide_length",
           "return size >= self._budget",
           TRI, "trigger: the slack trigger fires at the budget, not at budget + divide_length"),
    Mutant("triattention-prompt-not-pinned", "triattention", "kvbench/methods/triattention.py",
           "prefix = 0 if self.allow_prefill_compression else self._prefix",
           "prefix = 0",
           TRI, "selection: the prompt's entries compete with the decode entries"),
    Mutant("triattention-position-order", "triattention", "kvbench/methods/triattention.py",
           "        if self._order is None:",
           "        if True:",
           TRI, "bookkeeping: the cache scored in position order, not the code's stored order (the noise meets other "
                "entries: tied_scores_noise keeps other sets)"),
    Mutant("expected-attention-sinks-dropped", "expected_attention", "kvbench/methods/expected_attention.py",
           'sinks = torch.full((hkv, min(n_sink, keys.shape[1])), float("inf"), device=probs.device)',
           'sinks = torch.full((hkv, min(n_sink, keys.shape[1])), float("-inf"), device=probs.device)',
           [*SCORERS, "-k", "expected_attention"], "selection: the sink tokens always evicted instead of always kept"),
    Mutant("expected-attention-decode-keeps-buffer-sinks", "expected_attention",
           "kvbench/methods/expected_attention.py",
           "    q = pre_queries[:, n_sink:].float()",
           "    q = pre_queries.float()",
           ["tests/test_parity_kvpress_decoding.py", "-k", "expected_attention"],
           "statistics: the first n_sink queries kept (kvpress drops them, the decode buffer's too)"),
    Mutant("expected-attention-decode-queries-at-first-positions", "expected_attention",
           "kvbench/methods/expected_attention.py",
           "positions = layer.positions[:, :1, entries - n:].expand(b, hq, n)",
           "positions = layer.positions[:, :1, :n].expand(b, hq, n)",
           ["tests/test_parity_kvpress_decoding.py", "-k", "expected_attention"],
           "decode: the buffered queries un-rotated at the cache's first positions, not their own"),
    Mutant("adakv-safeguard-layer-alpha", "adakv", "kvbench/methods/adakv.py",
           "    n_safe = int(capacity * alpha)",
           "    n_safe = int(h * capacity * alpha)",
           [*SCORERS, "-k", "adakv"], "safeguard: alpha x the layer's budget per head instead of alpha x the head's"),
    Mutant("adakv-layer-total", "adakv", "kvbench/methods/adakv.py",
           "top = scores.reshape(-1).topk(min(h * capacity, h * n)).indices",
           "top = scores.reshape(-1).topk(min(capacity, h * n)).indices",
           [*SCORERS, "-k", "adakv"], "selection: the layer keeps one head's budget in all instead of heads x budget"),
    Mutant("adakv-no-safeguard", "adakv", "kvbench/methods/adakv.py",
           "    if n_safe:",
           "    if False:",
           [*SCORERS, "-k", "adakv"], "the safeguard: no head guaranteed alpha x budget"),
    Mutant("adakv-official-round-half-up", "adakv", "kvbench/methods/adakv.py",
           "budgets = torch.round(counts * (1 - alpha) + floor).int()[0]",
           "budgets = torch.round(counts * (1 - alpha) + floor + 0.5).int()[0]",
           ADAKV_OFFICIAL, "official allocation: budgets rounded up instead of torch.round's half to even"),
    Mutant("adakv-official-floor-with-window", "adakv", "kvbench/methods/adakv.py",
           "    floor = int(base * alpha)",
           "    floor = int(capacity * alpha)",
           ADAKV_OFFICIAL, "official allocation: the uniform share computed on the budget with the window"),
    Mutant("ragged-resident-counts-padding", "adakv", "kvbench/engine/cache.py",
           "return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()",
           "return 2 * self.lengths.numel() * self.width * self.keys.shape[-1] * self.keys.element_size()",
           RAGGED, "a ragged layer's resident bytes: the padded view's allocation instead of the kept entries"),
    Mutant("ragged-view-ignores-the-tail", "adakv", "kvbench/engine/cache.py",
           'return self.slots + torch.div(self.slots, self.width, rounding_mode="floor") * appended',
           "return self.slots",
           RAGGED, "a ragged layer's padded view: flat entries placed as if no token were appended"),
    Mutant("chunkkv-chunk-max", "chunkkv", "kvbench/methods/chunkkv.py",
           "chunk_scores = summed.view(complete, chunk).sum(-1)",
           "chunk_scores = summed.view(complete, chunk).amax(-1)",
           [*SCORERS, "-k", "chunkkv"], "chunk score: the chunk's maximum instead of its sum"),
    Mutant("chunkkv-count", "chunkkv", "kvbench/methods/chunkkv.py",
           "return kept, n_stay + min(k, complete) * chunk",
           "return kept, n_stay + min(k, complete) * chunk + 1",
           [*SCORERS, "-k", "chunkkv"], "the kept count the layer is sized by, from the host's arithmetic"),
    Mutant("chunkkv-chunks-over-kept", "chunkkv", "kvbench/methods/chunkkv.py",
           "free = valid & ~stay",
           "free = valid",
           [*SCORERS, "-k", "chunkkv"], "chunk boundaries: chunks cut through the must-keep entries (paper reading)"),
    Mutant("chunkkv-kvpress-chunk-offset", "chunkkv", "kvbench/methods/chunkkv.py",
           "return torch.isin(torch.arange(n, device=scores.device) // chunk, top)",
           "return torch.isin((torch.arange(n, device=scores.device) + 1) // chunk, top)",
           [*SCORERS, "-k", "chunkkv"], "chunk boundaries (kvpress reading): every chunk shifted one token left"),
    # ---- ThinK (kvbench/methods/think.py) ---------------------------------------------------------------------
    Mutant("think-key-norm-over-channels", "think", "kvbench/methods/think.py",
           "k_norm = torch.pow(keys, 2).mean(dim=2)",
           "k_norm = torch.pow(keys, 2).mean(dim=2, keepdim=True).mean(-1, keepdim=True).squeeze(2)",
           THINK, "channel score: the keys' overall magnitude instead of each channel's (queries alone decide)"),
    Mutant("think-prune-top-channels", "think", "kvbench/methods/think.py",
           "pruned.scatter_(-1, scores.topk(n_pruned, dim=-1, largest=False).indices, True)",
           "pruned.scatter_(-1, scores.topk(n_pruned, dim=-1, largest=True).indices, True)",
           THINK, "channel choice: the highest-scored channels pruned instead of the lowest"),
    # ---- KVzip (kvbench/methods/kvzip_ops.py) ------------------------------------------------------------------
    Mutant("kvzip-max-over-queries", "kvzip", "kvbench/methods/kvzip_ops.py",
           "torch.maximum(scores, probs[..., sink : sink + chunk].amax(dim=(-3, -2)), out=scores)",
           "torch.maximum(scores, probs[..., sink : sink + chunk].mean(dim=-2).amax(dim=-2), out=scores)",
           KVZIP, "score: the mean attention over the repeat queries (of a query block) instead of the max"),
    Mutant("kvzip-uniform-layers", "kvzip", "kvbench/methods/kvzip_ops.py",
           "per_layer = torch.bincount(pruned // (h * n), minlength=n_layers).tolist()",
           "per_layer = [n_pruned // n_layers] * n_layers",
           KVZIP, "selection: the global allocation split evenly over layers (layers keep the same numbers)"),
    Mutant("kvzip-sinks-not-forced", "kvzip", "kvbench/methods/kvzip_ops.py",
           "scores[..., :n_sink] = scores.amax() + 1.0",
           "scores[..., :0] = scores.amax() + 1.0",
           KVZIP, "selection: the first n_sink entries not forced to stay (scored like the others)"),
    # ---- decision-line boundaries (issue #39 item 5: tests/test_decision_edges.py) ------------------------------
    Mutant("keep-top-row-cap", "snapkv", "kvbench/methods/cache_ops.py",
           "            k = caps[row]\n",
           "            k = caps[0]\n",
           EDGES, "keep_top: rows keeping different numbers all keep the first row's number"),
    Mutant("keep-top-row-window", "snapkv", "kvbench/methods/cache_ops.py",
           "top, chosen = _top(own, k, windows[row])",
           "top, chosen = _top(own, k, windows[0])",
           EDGES, "keep_top: rows with their own windows all protect the first row's window"),
    Mutant("keep-top-row-single-eviction", "snapkv", "kvbench/methods/cache_ops.py",
           "elif m - k == 1 and not windows[row]:",
           "elif m - k == 2 and not windows[row]:",
           EDGES, "keep_top: a row losing one entry among rows losing more drops another tied entry than alone"),
    Mutant("keep-top-alike-rows-windows", "snapkv", "kvbench/methods/cache_ops.py",
           "if len(set(caps)) == 1 and len(set(windows)) == 1:",
           "if len(set(caps)) == 1:",
           EDGES, "keep_top: rows keeping as many but with different windows selected with the first row's window"),
    Mutant("keep-top-single-eviction-window", "snapkv", "kvbench/methods/cache_ops.py",
           "if overflow == 1 and not any(windows):",
           "if overflow == 1:",
           EDGES, "keep_top: a one-eviction call with a window evicts the lowest score inside the window"),
    Mutant("d2o-one-eviction-gate-strict", "d2o", "kvbench/methods/d2o_ops.py",
           "merge = m.double() >= torch.where(fresh, mean_m, tau).unsqueeze(-1)",
           "merge = m.double() > torch.where(fresh, mean_m, tau).unsqueeze(-1)",
           EDGES, "EMA gate, one eviction (eager and captured): a similarity equal to tau is not merged"),
    Mutant("d2o-official-gate-strict", "d2o", "kvbench/methods/d2o_ops.py",
           "merge = slot >= new.unsqueeze(-1)",
           "merge = slot > new.unsqueeze(-1)",
           EDGES, "official gate: a head-mean similarity equal to the updated tau is not merged"),
    Mutant("static-evict-one-at-capacity", "engine", "kvbench/engine/static.py",
           "over = valid.sum(-1, keepdim=True) > capacity",
           "over = valid.sum(-1, keepdim=True) >= capacity",
           EDGES, "static slots: a (row, head) holding exactly its capacity still evicts"),
    Mutant("static-evict-oldest-sink-edge", "engine", "kvbench/engine/static.py",
           "candidate = slots.valid & (slots.positions >= sinks)",
           "candidate = slots.valid & (slots.positions > sinks)",
           EDGES, "static sliding window: the first entry after the sinks is kept, the next one leaves"),
    Mutant("static-evict-oldest-free-slot", "engine", "kvbench/engine/static.py",
           "candidate = slots.valid & (slots.positions >= sinks)",
           "candidate = slots.positions >= sinks",
           EDGES, "static sliding window: a freed slot's stale position is chosen and nothing leaves"),
    Mutant("static-occupancy-evicting-grows", "engine", "kvbench/engine/session.py",
           "None if policy.evict is None else max(max(caps), held))",
           "None)",
           ["tests/test_static_decode.py", "-k", "equals_the_default_path and h2o"],
           "captured decode: an evicting layer's resident curve and bytes grow past its capacity (slots, not entries)"),
    Mutant("job-slots-selecting-method-keeps-all", "engine", "kvbench/methods/base.py",
           "if self.compression in (\"none\", \"attention\"):",
           "if self.compression in (\"none\",):",
           ["tests/test_job_graphs.py", "-k", "quest"],
           "job lengths: Quest's layers sized for the budget, below what they hold: a graph and a buffer per sample"),
    Mutant("job-slots-whole-prompt-keeps-all", "engine", "kvbench/methods/base.py",
           "if self.compression in (\"none\", \"attention\"):",
           "if self.compression in (\"attention\",):",
           ["tests/test_job_graphs.py", "-k", "holds_the_prompt_whole"],
           "job lengths: POD's values and TriAttention's prompt sized for the budget: a graph per sample"),
    Mutant("budget-full-own-label", "engine", "kvbench/budget.py",
           "        if own is not None:\n            raise ConfigError(",
           "        if False:\n            raise ConfigError(",
           ["tests/test_budget.py", "-k", "full_budget"],
           "budget=full accepted for POD/PyramidInfer paper/InfLLM explicit: FullKV filed under the method's label"),
    Mutant("decode-acts-at-full-budget", "engine", "kvbench/engine/session.py",
           "acts = not self.budget.is_full and idx in self._method_index  # as in prefill and the captured step",
           "acts = idx in self._method_index  # as in prefill and the captured step",
           ["tests/test_method_pod.py", "-k", "extension_point"],
           "the host-driven decode step runs the method at a full budget (POD: its attention, not FullKV's)"),
    Mutant("captured-attended-bucket-rows", "engine", "kvbench/engine/static.py",
           "count = (per_row * slots.rows).sum() // (slots.rows.sum() * (attended[..., 0].numel() // b))",
           "count = per_row.sum() // (b * (attended[..., 0].numel() // b))",
           ["tests/test_static_decode.py", "-k", "extra_rows"],
           "captured decode: the attended mean over the batch bucket's copy of the last row, not the batch's rows"),
    Mutant("ragged-bytes-past-end", "engine", "kvbench/engine/static.py",
           "past = getattr(self, \"past_end\", 0) * self.valid.shape[0] * self.valid.shape[1]",
           "past = 0",
           ["tests/test_static_decode.py", "-k", "past_the_end and kvzip"],
           "captured decode: a ragged cache's final bytes count the steps run past the generation's end"),
    Mutant("job-rows-bucket", "engine", "kvbench/engine/session.py",
           "return bucket(max(rows, self.job_rows or 0))",
           "return bucket(rows)",
           ["tests/test_job_graphs.py", "-k", "short_last_batch"],
           "a job's short last batch runs at its own bucket: a graph and buffers of its own"),
    Mutant("job-slots-content-shared", "engine", "kvbench/engine/session.py",
           "content = self.job_lengths is not None and (",
           "content = False and (",
           ["tests/test_job_graphs.py", "-k", "dynamickv or kvmerger or adakv"],
           "job lengths: DynamicKV's, KVMerger's, AdaKV's layers keep their own counts: a graph per sample"),
    Mutant("h2o-static-window-edge", "h2o", "kvbench/methods/h2o.py",
           "candidate = valid & (positions <= newest - recent)",
           "candidate = valid & (positions < newest - recent)",
           EDGES, "captured step: one entry more protected than the recent window"),
    Mutant("h2o-decode-window-edge", "h2o", "kvbench/methods/h2o.py",
           "layer.state[\"acc\"][..., : layer.num_entries - recent[0]].argmin(-1)",
           "layer.state[\"acc\"][..., : layer.num_entries - recent[0] + 1].argmin(-1)",
           EDGES, "decode fast path: the recent window's oldest entry can be evicted"),
    Mutant("graph-bucket-edge", "engine", "kvbench/engine/graph.py",
           "if rows <= size:",
           "if rows < size:",
           EDGES, "captured step: a batch of exactly a bucket's size runs in the next bucket"),
    Mutant("graph-bucket-multiple", "engine", "kvbench/engine/graph.py",
           "return -(-rows // BUCKETS[-1]) * BUCKETS[-1]",
           "return (rows // BUCKETS[-1] + 1) * BUCKETS[-1]",
           EDGES, "captured step: a batch of a multiple of 64 rows runs 64 rows more"),
    Mutant("graph-ring-modulus", "engine", "kvbench/engine/graph.py",
           "buffers.step.copy_((buffers.step + 1) % buffers.generated.shape[1])",
           "buffers.step.copy_((buffers.step + 1) % (buffers.generated.shape[1] - 1))",
           EDGES, "captured step: the ring of generated ids wraps one column early"),
    Mutant("graph-last-read", "engine", "kvbench/engine/graph.py",
           "columns = read_chosen(buffers, rows, 0, chunk)",
           "columns = read_chosen(buffers, rows, 0, read_every)",
           EDGES, "captured loop: the last partial read hands the host stale columns of the ring"),
    Mutant("graph-last-chunk", "engine", "kvbench/engine/graph.py",
           "chunk = min(read_every, steps - done)",
           "chunk = read_every",
           EDGES, "captured loop: the last chunk runs past the steps asked for"),
    Mutant("scores-causal-diagonal", "engine", "kvbench/engine/scores.py",
           "allowed = k_pos.view(1, -1) <= q_pos.view(-1, 1)",
           "allowed = k_pos.view(1, -1) < q_pos.view(-1, 1)",
           EDGES, "window attention: a query does not attend its own key"),
    Mutant("scores-window-queries", "engine", "kvbench/engine/scores.py",
           "probs = _masked_probs(logits, pos[n - window :], pos, key_valid)",
           "probs = _masked_probs(logits, pos[n - window - 1 : -1], pos, key_valid)",
           EDGES, "window attention: the observation window's queries masked one position early"),
    Mutant("scores-column-sums-diagonal", "engine", "kvbench/engine/scores.py",
           "logits[..., start:stop].masked_fill_(k_idx > q_idx, float(\"-inf\"))",
           "logits[..., start:stop].masked_fill_(k_idx >= q_idx, float(\"-inf\"))",
           EDGES, "column sums: the causal mask drops the diagonal"),
    Mutant("scores-column-sums-query-start", "engine", "kvbench/engine/scores.py",
           "for start in range(query_start, n, chunk):",
           "for start in range(query_start + 1, n, chunk):",
           EDGES, "column sums: the query at query_start does not contribute"),
    Mutant("scores-window-block-edge", "h2o", "kvbench/engine/scores.py",
           "future = (k_idx > q_idx) & (q_idx >= n - window) & (k_idx >= n - window)",
           "future = (k_idx > q_idx) & (q_idx > n - window) & (k_idx >= n - window)",
           EDGES, "kvfactory_2410 scores: the window's first query sees the window's later keys"),
    Mutant("streamingllm-decode-sink-edge", "streamingllm", "kvbench/methods/streamingllm.py",
           "layer.evict_at(self.sink_size)",
           "layer.evict_at(self.sink_size - 1)",
           EDGES, "decode fast path: the last sink leaves instead of the first entry after the sinks"),
    Mutant("streamingllm-sink-rank-edge", "streamingllm", "kvbench/methods/streamingllm.py",
           "keep = ((rank >= 0) & (rank < head)) | (rank >= count - recent)",
           "keep = ((rank >= 0) & (rank <= head)) | (rank >= count - recent)",
           EDGES, "padded decode: one sink more (the first entry after the sinks is never evicted)"),
    Mutant("quest-static-newest-page", "quest", "kvbench/methods/quest.py",
           "last = (valid.sum(-1, keepdim=True) - 1) // page_size",
           "last = valid.sum(-1, keepdim=True) // page_size",
           EDGES, "captured step: a just-completed newest page taken for the (empty) next one"),
    Mutant("quest-pages-ceil", "quest", "kvbench/methods/quest.py",
           "num_pages = -(-t // p)",
           "num_pages = t // p",
           EDGES, "decode: a partial newest page not counted as a page"),
    Mutant("quest-newest-page-start", "quest", "kvbench/methods/quest.py",
           "last = torch.arange((num_pages - 1) * p, t, device=top.device)",
           "last = torch.arange((num_pages - 1) * p + 1, t, device=top.device)",
           EDGES, "decode: the newest page's first entry not attended"),
    Mutant("quest-dense-at-page-budget", "quest", "kvbench/methods/quest.py",
           "if num_pages <= page_budget:",
           "if num_pages < page_budget:",
           ["tests/test_method_quest.py"], "decode: exactly page_budget pages run the paged step, not the dense one"),
    Mutant("omnikv-eager-prompt-rows-edge", "omnikv", "kvbench/methods/omnikv_select.py",
           "prompt_rows = int((positions[0] < n).sum())",
           "prompt_rows = int((positions[0] <= n).sum())",
           EDGES, "window selection: the first generated token's query counted as a prompt row"),
    Mutant("omnikv-static-prompt-rows-edge", "omnikv", "kvbench/methods/omnikv_select.py",
           "prompt_rows = (held & (positions < prompt)).sum(-1, keepdim=True)",
           "prompt_rows = (held & (positions <= prompt)).sum(-1, keepdim=True)",
           EDGES, "captured choice: the first generated token's query counted as a prompt row"),
    Mutant("omnikv-static-forced-edge", "omnikv", "kvbench/methods/omnikv_select.py",
           "forced = inside & (column >= prompt - prompt_rows)",
           "forced = inside & (column > prompt - prompt_rows)",
           EDGES, "captured choice: the window's oldest prompt token not forced"),
    Mutant("omnikv-static-keep-count", "omnikv", "kvbench/methods/cache_ops.py",
           "return torch.empty_like(order).scatter_(-1, order, ranks) < k",
           "return torch.empty_like(order).scatter_(-1, order, ranks) <= k",
           EDGES, "captured choice: one token more than k (the official reading: max(1, k - p) + p)"),
    Mutant("omnikv-static-one-chosen", "omnikv", "kvbench/methods/omnikv_select.py",
           "total = torch.minimum(torch.clamp(k - prompt_rows, min=1) + prompt_rows, prompt)",
           "total = torch.minimum(torch.clamp(k - prompt_rows, min=0) + prompt_rows, prompt)",
           EDGES, "captured choice (official reading): no token chosen when k <= p (the code chooses one)"),
    Mutant("pyramidkv-uniform-edge", "pyramidkv", "kvbench/methods/pyramidkv.py",
           "if n < 2 * base:",
           "if n <= 2 * base:",
           EDGES, "capacity: a prompt of exactly 2 (C - w) tokens kept uniform instead of the pyramid"),
    Mutant("pyramidkv-largest-remainder", "pyramidkv", "kvbench/methods/pyramidkv.py",
           "order = torch.argsort(ideal - rounded, descending=True)",
           "order = torch.argsort(ideal - rounded, descending=False)",
           EDGES, "capacity (exact): the missing tokens go to the smallest remainders"),
    Mutant("cam-merge-span-inside", "cam", "kvbench/methods/cam_ops.py",
           "inside = ((diff > 0) & (diff <= span))",
           "inside = ((diff > 0) & (diff < span))",
           ["tests/test_method_cam.py", "-k", "merge_values"], "merge: the token exactly span after x gets nothing"),
    Mutant("cam-merge-span-behind", "cam", "kvbench/methods/cam_ops.py",
           "behind = (diff + k <= span)",
           "behind = (diff + k < span)",
           ["tests/test_method_cam.py", "-k", "merge_values"],
           "merge: across a block edge, the token exactly span after x gets nothing"),
    Mutant("cam-merge-last-target", "cam", "kvbench/methods/cam_ops.py",
           "stop = min(n, first + steps + span)",
           "stop = min(n, first + steps + span - 1)",
           ["tests/test_method_cam.py", "-k", "merge_values"], "merge: the last source's last target left out"),
    Mutant("cam-static-leaving", "cam", "kvbench/methods/cam.py",
           "s.expand(-1, ordered.shape[1]).unsqueeze(-1)",
           "(s + 1).expand(-1, ordered.shape[1]).unsqueeze(-1)",
           ["tests/test_static_decode.py", "-k", "cam_merges"],
           "captured decode: the second-oldest recent token leaves instead of the oldest"),
    Mutant("cam-static-targets", "cam", "kvbench/methods/cam.py",
           "targets = valid & (positions > leaving_pos.unsqueeze(-1))",
           "targets = valid & (positions >= 0)",
           ["tests/test_static_decode.py", "-k", "cam_merges"],
           "captured decode: the start tokens take the merge too"),
    Mutant("cam-decode-draw-position", "cam", "kvbench/methods/cam.py",
           "u = decode_uniforms(layer_key(self.seed, ctx.layer_idx), layer.positions[..., s])",
           "u = decode_uniforms(layer_key(self.seed, ctx.layer_idx), layer.positions[..., s + 1])",
           CAM, "decode: the draw of another token's position"),
    Mutant("kvmerger-device-accept-edge", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "accept = count <= room",
           "accept = count < room",
           EDGES, "device theta search: a threshold giving exactly the room's set count is rejected"),
    Mutant("kvmerger-device-fits-edge", "kvmerger", "kvbench/methods/kvmerger_ops.py",
           "fits = room[:, 0] >= mergeable.sum(-1)",
           "fits = room[:, 0] > mergeable.sum(-1)",
           EDGES, "device theta search: a head whose every mergeable token fits its room still searches"),
    Mutant("d2o-static-sink-edge", "d2o", "kvbench/methods/d2o_ops.py",
           "protect = (rank < sinks) | (rank >= counts - recent)",
           "protect = (rank <= sinks) | (rank >= counts - recent)",
           EDGES, "captured step: the first entry after the sinks protected"),
    Mutant("d2o-static-recent-edge", "d2o", "kvbench/methods/d2o_ops.py",
           "protect = (rank < sinks) | (rank >= counts - recent)",
           "protect = (rank < sinks) | (rank > counts - recent)",
           EDGES, "captured step: the recent window's oldest entry can be evicted"),
    Mutant("d2o-eager-sink-edge", "d2o", "kvbench/methods/d2o.py",
           "victim = layer.state[\"acc\"][..., sinks : layer.num_entries - recent].argmin(-1) + sinks",
           "victim = layer.state[\"acc\"][..., sinks - 1 : layer.num_entries - recent].argmin(-1) + sinks - 1",
           EDGES, "decode fast path: the last sink can be evicted"),
    Mutant("d2o-eager-recent-edge", "d2o", "kvbench/methods/d2o.py",
           "victim = layer.state[\"acc\"][..., sinks : layer.num_entries - recent].argmin(-1) + sinks",
           "victim = layer.state[\"acc\"][..., sinks : layer.num_entries - recent + 1].argmin(-1) + sinks",
           EDGES, "decode fast path: the recent window's oldest entry can be evicted"),
    Mutant("h2o-recent-at-most-budget-minus-one", "h2o", "kvbench/methods/h2o.py",
           "long(), 1, None).clamp(max=capacity - 1)",
           "long(), 1, None).clamp(max=capacity)",
           EDGES, "recent window: a ratio near 1 leaves no heavy hitter"),
    Mutant("h2o-recent-at-least-one", "h2o", "kvbench/methods/h2o.py",
           "long(), 1, None).clamp(max=capacity - 1)",
           "long(), 0, None).clamp(max=capacity - 1)",
           EDGES, "recent window: a small ratio protects no recent token"),
    Mutant("h2o-recent-half-up", "h2o", "kvbench/methods/h2o.py",
           "torch.round(capacity * ratio)",
           "torch.floor(capacity * ratio + 0.5)",
           EDGES, "recent window: halves rounded up instead of to even"),
]


def copy_tree(dest: Path) -> None:
    """The working tree as it is (tracked and untracked, not ignored files) into ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, str]:
    """("passed" | "failed" | "timeout", last output line) of the tests in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"ran past {timeout:g} s"
    lines = [line for line in done.stdout.strip().splitlines() if line.strip()]
    return ("passed" if done.returncode == 0 else "failed"), (lines[-1] if lines else done.stderr.strip()[-200:])


def stale(mutants: list[Mutant], root: Path) -> list[str]:
    """A line for each mutant whose original text does not occur exactly once in its file."""
    out = []
    for m in mutants:
        path = root / m.file
        count = path.read_text().count(m.original) if path.is_file() else 0
        if count != 1:
            where = "missing file" if not path.is_file() else f"occurs {count} times"
            out.append(f"{m.id}: original text {where} in {m.file}: {m.original!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids")
    parser.add_argument("--method", nargs="*", default=None, help="methods (omnikv kvmerger pod d2o dynamickv)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (past it: killed)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if (args.only is None or m.id in args.only)
              and (args.method is None or m.method in args.method)]
    unknown = set(args.only or ()) - {m.id for m in MUTANTS}
    if unknown or not chosen:
        print(f"no such mutant: {', '.join(sorted(unknown))}" if unknown else "no mutant selected", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id:32s} {m.file}: {m.what}\n{'':32s} tests: {' '.join(m.tests)}")
        return 0
    problems = stale(chosen, REPO)
    if problems:
        print("the mutant list is stale:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2

    def interrupted(signum, frame):  # SIGTERM: unwind through the finally blocks like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background (SIGINT ignored)
    tree = Path(tempfile.mkdtemp(prefix="kvbench-mutants-"))
    results: list[tuple[Mutant, str, str, float]] = []
    try:
        copy_tree(tree)
        for tests in sorted({tuple(m.tests) for m in chosen}):
            status, last = run_tests(tree, list(tests), args.timeout)
            print(f"baseline {' '.join(tests)}: {status} ({last})", flush=True)
            if status != "passed":
                print("the unmutated tests fail: fix them before reading mutants", file=sys.stderr)
                return 2
        for m in chosen:
            path = tree / m.file
            original = path.read_text()
            start = time.perf_counter()
            try:
                path.write_text(original.replace(m.original, m.mutated, 1))
                status, last = run_tests(tree, m.tests, args.timeout)
            finally:
                path.write_text(original)
            verdict = "survived" if status == "passed" else "killed"
            results.append((m, verdict, last if status != "timeout" else "timeout: " + last,
                            time.perf_counter() - start))
            print(f"{verdict:8s} {m.id} ({m.what}) [{results[-1][3]:.0f} s] {last}", flush=True)
    except KeyboardInterrupt:
        print("interrupted; the working tree was never modified", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    survived = [m.id for m, verdict, _, _ in results if verdict == "survived"]
    print(f"\n{len(results) - len(survived)} killed, {len(survived)} survived of {len(results)} mutants")
    for m, verdict, _, seconds in results:
        print(f"  {verdict:8s} {m.method:10s} {m.id:32s} {seconds:4.0f} s")
    if survived:
        print("survivors (add a test that fails on them): " + ", ".join(survived))
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
