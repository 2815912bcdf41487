"""Issue #21 on GPUs: no method's prefill is host-bound. Counted on the CPU through torch's dispatcher, as
tests/test_host_sync.py counts decode steps.

A GPU prefill that launches thousands of small kernels per layer (KVMerger's and CaM's chunk loops, 22-34x FullKV's
prefill on an H100) waits on the host. With ``few_kernels`` (what the session sets on CUDA) the scoring passes take a
form whose kernels do not grow with the prompt: the column sums as two fused attention kernels, CaM's Λ attention in
one batched pass of blocks and its merge in a fixed number of blocks, KVMerger's merging sets by a similarity staircase
and pointer doubling on the device, D2O's nearest kept entries in one pass. And the scoring paths read nothing back to
the host (``.item()``, ``bool(t)``, ``nonzero``, boolean indexing): a read serialises the GPU's queue.

Issue #37 (prefill within bounds on the GPU for every method): every method that runs on the toy model, per
attention layer. Measured with ``_prefill_counts`` (``few_kernels=True``, budget 128, the 3-layer toy Llama, one
row, torch 2.13 CPU): device kernels and host reads of device tensors in layers 0/1/2, then ``+`` those outside
every attention module (embeddings, norms, MLPs, the LM head: 74 kernels; SirLLM's ``observe_logits``; KVzip's
repeat forwards outside attention). A method's cross-layer ``finish_prefill`` runs inside the last layer's
attention. ``LayerCounts`` counts what a GPU run would put on the device (the model's tensors and what is computed
from them) and not what it would compute in host memory (after a ``.cpu()``, itself a read, or from factories given
no device): D2O's allocation, a bisection over one number per layer, read the device at each step (220 reads and
1,226 kernels in the last layer) and now reads the layers' densities once and runs on the host, and each layer's
compression sizes its selection from the layer's host capacities (2 reads, 374 kernels: the rest is its per-layer
compression, about 110 kernels a layer; on 32 layers 97 -> 2 reads); DynamicKV's re-allocations truncated each
earlier layer with ``keep_top`` (a selection and a read per layer and update: 112 kernels and 8 reads in the last
layer here; 3,328 kernels and 160 reads in the layers of a 32-layer toy at 2k, 144 truncations) and now keep a
prefix of the code's score-ordered temporary cache, sized on the host (81 and 2 here; 2,034 and 10 on 32 layers,
SnapKV's 1,763 and 34; the first keep is the same sort at any prompt length, so its budget-128 branch at 1k is
gone); every selection's check whether its new mask has an empty slot (``keep_top``'s, ``set_valid``'s) was a read
per layer (SnapKV: 34 reads on 32 layers) and is now read for all layers at once after the last one
(``KVLayer.defer_valid_check``, ``check_deferred_valid``: 3); a ragged layer (AdaKV's and KVzip's layout) is built
with two reads, not seven (``KVLayer.to_ragged``: its order check, widths and uniformity in one, the kept entries'
index in the other; now one: the total kept joins the first read and a stable sort builds the index, where
``nonzero`` read its size); AdaKV and ChunkKV read the scorer's must-keep count from its scores per layer (SnapKV's
and PyramidKV's window: ``Method.must_keep_count`` now says it on the host for an unpadded prompt), so AdaKV's 4/3/4
reads are 2/1/2 (the ragged layout's one) and ChunkKV's 2/1/2 are 1/0/1; KVzip's ragged layers read 3 times less.

| method | kernels 1k | kernels 4k | host reads 1k | host reads 4k |
|---|---|---|---|---|
| adakv | 90/88/101 +74 | 90/88/101 +74 | 2/1/2 +0 | 2/1/2 +0 |
| cam | 225/223/237 +74 | 225/223/237 +74 | 1/0/2 +0 | 1/0/2 +0 |
| chunkkv | 71/69/79 +74 | 71/69/79 +74 | 1/0/1 +0 | 1/0/1 +0 |
| d2o | 55/53/374 +74 | 55/53/374 +74 | 1/0/2 +0 | 1/0/2 +0 |
| dynamickv | 47/45/81 +74 | 47/45/81 +74 | 1/0/2 +0 | 1/0/2 +0 |
| expected_attention | 85/83/97 +74 | 85/83/97 +74 | 1/0/2 +0 | 1/0/2 +0 |
| fullkv (no budget) | 25/23/33 +74 | 25/23/33 +74 | 1/0/1 +0 | 1/0/1 +0 |
| h2o | 73/71/85 +74 | 73/71/85 +74 | 1/0/2 +0 | 1/0/2 +0 |
| infllm (GROWS) | 1260/1258/1268 +74 | 5148/5146/5156 +74 | 1/0/1 +0 | 1/0/1 +0 |
| keydiff (GROWS) | 136/134/144 +74 | 448/446/456 +74 | 2/1/2 +0 | 2/1/2 +0 |
| knorm | 38/36/50 +74 | 38/36/50 +74 | 1/0/2 +0 | 1/0/2 +0 |
| kvmerger | 411/409/423 +74 | 411/409/423 +74 | 1/0/2 +0 | 1/0/2 +0 |
| kvzip (GROWS) | 65/58/68 +277 | 104/92/102 +358 | 1/0/1 +6 | 1/0/1 +6 |
| lminfinite | 126/124/138 +74 | 126/124/138 +74 | 1/0/2 +0 | 1/0/2 +0 |
| local | 44/42/56 +74 | 44/42/56 +74 | 1/0/2 +0 | 1/0/2 +0 |
| omnikv | 25/23/33 +74 | 25/23/33 +74 | 1/0/1 +0 | 1/0/1 +0 |
| pod | 25/23/33 +74 | 25/23/33 +74 | 1/0/1 +0 | 1/0/1 +0 |
| pyramidinfer | 52/58/59 +74 | 52/58/59 +74 | 1/0/1 +0 | 1/0/1 +0 |
| pyramidkv | 53/51/65 +74 | 53/51/65 +74 | 1/0/2 +0 | 1/0/2 +0 |
| quest | 25/23/33 +74 | 25/23/33 +74 | 1/0/1 +0 | 1/0/1 +0 |
| roco (GROWS; 160 and 320 tokens) | 1324/1322/1336 +74 | 7564/7562/7576 +74 | 1/0/2 +0 | 1/0/2 +0 |
| sirllm (GROWS) | 25/23/33 +230 | 25/23/33 +266 | 1/0/1 +4 | 1/0/1 +4 |
| snapkv | 53/51/65 +74 | 53/51/65 +74 | 1/0/2 +0 | 1/0/2 +0 |
| streamingllm | 47/45/59 +74 | 47/45/59 +74 | 1/0/2 +0 | 1/0/2 +0 |
| think | 53/51/101 +74 | 53/51/101 +74 | 1/0/2 +0 | 1/0/2 +0 |
| tova | 44/42/56 +74 | 44/42/56 +74 | 1/0/2 +0 | 1/0/2 +0 |
| rkv | 78/76/90 +74 | 78/76/90 +74 | 1/0/2 +0 | 1/0/2 +0 |
| triattention | 25/23/33 +74 | 25/23/33 +74 | 1/0/1 +0 | 1/0/1 +0 |

GPU prefill at 4k on an H200 (reference/gpu.md, ratio to FullKV) against these counts: KVMerger (11.1x) and CaM
(3.7x) launched a constant but large number of kernels per layer (1,585 and 268; KVMerger's theta bisection now
evaluates 8 of its 24 steps per batched pass, ``kvmerger_ops.SEARCH_LEVELS``: 409; CaM's merge builds its 16 blocks'
systems at once: 225), AdaKV (1.44x) read the device 15 times per layer (5 + one per KV head; now 2: its per-head
budgets applied on the device, its ragged layout built from one index), DynamicKV (1.47x) read it 12 times in its
last layer and truncated 144 layers by a selection each on 32 layers (now 2 reads, and a prefix copy per
truncation), D2O (1.91x) 220 times in its allocation (now 2); KeyDiff (1.97x), KVzip (18.7x) and RoCo (54 s) grow
with the prompt (``GROWS``): KVzip by one repeat forward per 2,048 tokens, and by its scoring's query blocks of 4
MiB, which on Llama-3-8B's shapes were about 260 blocks of 8 kernels per layer and chunk (145 -> 774 per layer
here); with ``few_kernels`` they are blocks of 512 MiB (``kvzip_ops.PASS_ELEMENTS``: 65 -> 104). RoCo runs at 160
and 320 tokens (``LENGTHS``; at 1k and 4k, 9 s and 62 s under the dispatch mode, its counts were 35,021 and 154,829
per layer). PyramidInfer's layers 1-2 took 66 -> 114 kernels before its masked attention ran in passes of
``PASS_BYTES`` with ``few_kernels``.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_host_sync import NOT_ON_TOY, CountOps, is_host_read, is_kernel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import ByteTokenizer, kept_positions, make_layer, method_fields, prefill_ctx
from kvbench.budget import Budget
from kvbench.engine import CompressionSession
from kvbench.engine.scores import attention_and_column_sums, window_attention
from kvbench.methods import METHODS, build_method, cam_ops
from kvbench.methods.base import scorer_names
from kvbench.methods.kvmerger import KVMerger
from kvbench.methods.kvmerger_ops import device_sets, merge_sets, runs_of

# not a constant-kernel prefill, and why (the counts grow with the prompt: asserted, so that this list cannot go stale)
GROWS = {
    "keydiff": "the paper's block-wise procedure (kvpress BlockPress, mode=block, the default): each block of "
               "block_size=128 tokens is scored against what the previous blocks kept, a sequential loop of "
               "(n - budget) / 128 steps, 13 kernels each (21 before each key's directions were computed once per "
               "prompt: 189 -> 693 per layer, now 136 -> 448); mode=whole_prompt is one scoring",
    "roco": "the published procedure evicts per token (stride=1): token t attends over the cache that token t-1's "
            "eviction left, a loop of n - budget steps, 39 kernels each (35,021 -> 154,829 per layer)",
    "infllm": "the official chunked prefill: chunk i (exc_block_size 512, clamped to n_local) attends over the memory "
              "blocks that chunks < i formed, a loop of n / chunk steps (1,260 -> 5,148 per layer)",
    "kvzip": "the context reconstruction: one repeat forward per chunk_size=2048 prompt tokens (the official KVzip "
             "and kvpress chunking), each through every layer (65 -> 104 in layer 0, 277 -> 358 outside)",
    "sirllm": "not in the attention layers (equal per layer): the engine's TokenLogits applies the LM head 256 "
              "positions at a time to score the prompt's tokens (observe_logits, outside the layers: 230 -> 266)",
}
# prompt lengths where 1k and 4k would take too long under the dispatch mode (RoCo: 9 s at 1k, 62 s at 4k)
LENGTHS = {"roco": (160, 320)}
BUDGETS = {"fullkv": None}
FIELDS = {"omnikv": {"filter_layers": [0]}}  # the default filter layers leave no sparse layer on 3 layers
OUTSIDE = "outside"  # ops outside every attention module: embeddings, MLPs, norms, the LM head, observe_logits


#: tensor factories: called without a ``device`` they make a host tensor on a GPU run (``LayerCounts``)
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace", "rand", "randn", "randint",
             "eye", "randperm"}


class _HostFactories(TorchFunctionMode):
    """``LayerCounts``' view of the Python calls: a factory called without a ``device`` makes a host tensor (its ops
    are not the device's; the dispatcher below it sees the default device filled in, so it is told here)."""

    def __init__(self, counts: LayerCounts):
        super().__init__()
        self.counts, self.depth = counts, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host = getattr(func, "__name__", "") in FACTORIES and kwargs.get("device") is None
        self.depth += host
        try:
            out = func(*args, **kwargs)
        finally:
            self.depth -= host
        if host and isinstance(out, torch.Tensor):
            self.counts.mark_host(out)
        return out


class LayerCounts(TorchDispatchMode):
    """Kernels and host reads per attention layer: forward pre-hooks and hooks on each attention module set the layer
    the dispatched ops are charged to (what the method does inside ``attend``, including its per-layer prefill and a
    cross-layer ``finish_prefill``, which runs inside the last layer's attention); ops outside any attention module
    go to ``OUTSIDE``. ``Tensor.tolist`` does not reach the dispatcher: counted as a host read by a patch.

    Only the device's work is counted, as a GPU would run it: on this CPU the model's tensors stand for device
    tensors, and a tensor is the host's where a GPU run would hold it in host memory: made by ``.cpu()`` (itself a
    read: a copy the host waits for), by a factory given no ``device``, or by ops on host tensors alone. Ops on those
    launch no kernel and reading them waits for nothing (a method that reads a few numbers once and computes on them
    on the host, D2O's layer allocation, is charged one read, not one per step of its loop)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.where = model, OUTSIDE
        self.kernels: dict = {}
        self.reads: dict = {}
        self._host: dict[int, weakref.ref] = {}  # tensors a GPU run would hold in host memory (by identity)
        self._factory = _HostFactories(self)  # (the dispatcher sees every factory with a device: the call's own kwargs)

    def _charge(self, table: dict) -> None:
        table[self.where] = table.get(self.where, 0) + 1

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def _on_host(self, args, kwargs) -> bool:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(self.is_host(t) for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        host = self._factory.depth > 0 or self._on_host(args, kwargs)
        if not host and is_kernel(name, args):
            self._charge(self.kernels)
        if not host and is_host_read(name, args):
            self._charge(self.reads)
        out = func(*args, **kwargs)
        if host:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out

    def __enter__(self):
        modules = [m for m in self.model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
        assert modules, "no attention module found"
        self._hooks = [h for m in modules for h in (
            m.register_forward_pre_hook(lambda mod, args: setattr(self, "where", mod.layer_idx)),
            m.register_forward_hook(lambda mod, args, out: setattr(self, "where", OUTSIDE)))]
        self._tolist = real = torch.Tensor.tolist
        self._cpu = real_cpu = torch.Tensor.cpu
        busy = []  # the function mode below resolves a patched method again: one charge per call

        def tolist(t):
            if not busy and not self.is_host(t):
                self._charge(self.reads)
            busy.append(1)
            try:
                return real(t)
            finally:
                busy.pop()

        def cpu(t, *args, **kwargs):  # a device-to-host copy (on this CPU, the tensor itself): a read, then host
            if busy or self.is_host(t):
                return real_cpu(t, *args, **kwargs)
            self._charge(self.reads)
            busy.append(1)
            try:
                out = real_cpu(t, *args, **kwargs).clone()
            finally:
                busy.pop()
            self.mark_host(out)
            return out

        torch.Tensor.tolist, torch.Tensor.cpu = tolist, cpu
        self._factory.__enter__()
        for layer in [m.layer_idx for m in modules] + [OUTSIDE]:
            self.kernels.setdefault(layer, 0)
            self.reads.setdefault(layer, 0)
        return super().__enter__()

    def __exit__(self, *exc):
        self._factory.__exit__(*exc)
        torch.Tensor.tolist = self._tolist
        torch.Tensor.cpu = self._cpu
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def as_row(self) -> tuple[dict, dict]:
        return dict(self.kernels), dict(self.reads)


def _prefill_counts(model, name, n, budget=128) -> tuple[dict, dict]:
    """Kernels and host reads per attention layer (and outside them) of one prompt's forward (prefill) with the method
    acting, its constant-kernel form (``few_kernels``, the session's choice on CUDA). KVzip's repeat forwards run
    inside this forward (a hook on the model) and are counted with it."""
    ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(n))
    b = Budget.parse(BUDGETS.get(name, budget))
    method = build_method({"name": name, **FIELDS.get(name, {}), **method_fields(name, model)}, b)
    with CompressionSession(model, method, b, few_kernels=True, tokenizer=ByteTokenizer()):
        with LayerCounts(model) as counts:
            model(ids, use_cache=True)
    return counts.as_row()


#: methods whose padded rows' selection reads what one row's does in the middle layers (the others' ``keep_top`` reads
#: a padded cache's counts: three reads per layer, whatever the rows)
AS_ONE_ROW = {"adakv", "chunkkv", "keydiff"}


@pytest.mark.parametrize("method", ["adakv", "chunkkv", "keydiff", "expected_attention", "d2o", "snapkv"])
def test_a_left_padded_batch_reads_no_more_per_layer_than_one_row(toy_llama, method):
    """A left-padded batch (the generation loop's) is checked once per prompt to be left padding; each row's tokens
    are then a slice of host ints (``PrefillContext.row_tokens``) and the scorer's must-keep count that of the row's
    length, so AdaKV and ChunkKV select every row without a read (indexing by a row's mask read its count, and the
    scores' +inf count was read, per row and layer), and the prompt's padding mask is stored in each layer unread:
    four rows read per layer what two do. So do Expected Attention's statistics, KeyDiff's anchors and blocks and
    D2O's layer variance, over each row's own tokens (at four rows 17/15/17, 7/5/7 and 6/4/18 reads per layer, one
    more per row; now 5/3/5, 3/1/3 and 2/0/14)."""
    b = Budget.parse(128)

    def reads(rows: int) -> dict:
        method = build_method({"name": method_name, **method_fields(method_name, toy_llama)}, b)
        ids = torch.randint(3, 250, (rows, 600), generator=torch.Generator().manual_seed(rows))
        mask = torch.ones(rows, 600, dtype=torch.long)
        for row in range(1, rows):
            mask[row, : 37 * row] = 0  # left padding: rows of 600, 563, 526, 489 tokens
        forward = dict(attention_mask=mask if rows > 1 else None, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       use_cache=True)
        with CompressionSession(toy_llama, method, b, few_kernels=True):
            toy_llama(ids, **forward)  # the session's first prompt checks each layer's reading of the mask, once
            with LayerCounts(toy_llama) as counts:
                toy_llama(ids, **forward)
        return counts.as_row()[1]

    method_name = method
    one, two, four = reads(1), reads(2), reads(4)
    assert four == two, (two, four)  # the reads do not grow with the rows (they grew by one or two per row and layer)
    # a padded prompt's middle layers read what an unpadded one's do; its first layer reads whether keys are padding,
    # its last (ChunkKV) whether its masks kept an empty slot, and transformers reads the padded mask outside them
    if method in AS_ONE_ROW:
        assert four[1] == one[1] and four[0] <= one[0] + 1 and four[2] <= one[2] + 1, (one, four)


@pytest.mark.parametrize("method", sorted(set(METHODS.names()) - NOT_ON_TOY))
def test_prefill_counts_per_layer_do_not_grow_with_the_prompt(toy_llama, method):
    """Every method that runs on the toy model: the same kernels and the same host reads in every attention layer
    (and outside them) at 1k and 4k prompt tokens, budget 128: its scoring passes are one batched pass whatever the
    prompt (their byte limits, ``PASS_BYTES`` & co., are far above a 4k prompt's). Per layer, not in total, so that
    one layer's growth cannot hide behind another's saving. A method in ``GROWS`` must grow (else it leaves the
    list): its counts are printed (``pytest -s``) for the table above."""
    short_n, long_n = LENGTHS.get(method, (1024, 4096))
    short, long = (_prefill_counts(toy_llama, method, n) for n in (short_n, long_n))
    print(f"\n{method}: kernels {short[0]} -> {long[0]}, host reads {short[1]} -> {long[1]} ({short_n} -> {long_n})")
    if method in GROWS:
        assert sum(long[0].values()) > sum(short[0].values()), f"{method} no longer grows: remove it from GROWS"
    else:
        assert short == long, (short, long)
    # the table's host reads are the method's (its kernels depend on torch's decompositions, its reads on kvbench)
    assert (_cells(short[1]), _cells(long[1])) == TABLE_READS[method], (method, short[1], long[1])


def _cells(counts: dict) -> str:
    """Per-layer counts as the table writes them: ``0/1/2 +outside``."""
    return "/".join(str(counts[i]) for i in range(3)) + f" +{counts[OUTSIDE]}"


def _table_reads(doc: str) -> dict[str, tuple[str, str]]:
    rows = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| ") and "/" in line]
    return {cells[0].split()[0]: (cells[3].strip(), cells[4].strip()) for cells in rows}


TABLE_READS = _table_reads(__doc__)


def test_the_counts_charge_the_device_and_not_the_host(toy_llama):
    """``LayerCounts`` counts what a GPU would wait for: reading a device tensor (the model's, or anything computed
    from it) at each step of a loop is a read per step; reading its values once with ``.cpu()`` and looping on the
    host copy is one read and no kernel after it; a factory without a device makes a host tensor, one with the
    model's device a device tensor."""
    with LayerCounts(toy_llama) as counts:
        x = toy_llama.model.embed_tokens.weight[:8, 0] * 2  # a device tensor (1 kernel)
        for i in range(5):
            int(x[i] > 0)  # a read per step
        host = x.cpu()  # one read
        for i in range(5):
            int((host[i] * 3) > 0)  # host work: nothing counted
        torch.zeros(3).sum().item()  # a host factory: nothing counted
        torch.tensor([1.0, 2.0]).tolist()  # nor here
        torch.zeros(3, device=x.device).sum().item()  # a device factory: 2 kernels, 1 read
        host.tolist()  # a host copy: nothing counted
        x.tolist()  # a device tensor: one read
    assert counts.reads[OUTSIDE] == 5 + 1 + 1 + 1
    # the product; per step a comparison and its scalar read (an op too); the copy; zeros, sum and its scalar read
    assert counts.kernels[OUTSIDE] == 1 + 5 * 2 + 1 + 3


@pytest.mark.parametrize("granularity", ["kv_head", "query_head"])
def test_dynamickv_re_allocations_cut_prefixes_without_a_read(granularity):
    """DynamicKV re-allocates layers 0..l-1 after every 4th layer (8 times on a 32-layer model, 144 truncations): each
    truncation cut its layer by ``keep_top`` (a selection, about 14 kernels and a read), 3,328 kernels and 160 reads in
    the layers of a 32-layer toy prefill. The layers now hold the code's score-ordered temporary cache, so a
    truncation keeps a prefix sized on the host: a copy of keys, values and positions, no read. Here on 12 layers:
    a re-allocation reads once (its flat top-K's counts), a truncated layer costs at most 3 kernels, and a layer
    between re-allocations costs what every such layer costs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    ids = torch.randint(3, 250, (1, 1000), generator=torch.Generator().manual_seed(3))
    rows = {}
    for name, budget in (("fullkv", None), ("dynamickv", 64)):
        b = Budget.parse(budget)
        method = build_method({"name": name, **({"granularity": granularity} if budget else {})}, b)
        with CompressionSession(model, method, b, few_kernels=True):
            with LayerCounts(model) as counts:
                model(ids, use_cache=True)
        rows[name] = counts.as_row()
    kernels, reads = rows["dynamickv"]
    full = rows["fullkv"][0]
    updates = {3: 4, 7: 8, 11: 12}  # layer -> layers re-allocated (the last layer's: finish_prefill, inside it)
    engine = {0: 1, 11: 1}  # the session's reads of the prompt's lengths and of the prefill's resident entries
    assert {i: reads[i] for i in range(12)} == {i: (i in updates) + engine.get(i, 0) for i in range(12)}
    plain = kernels[1]
    assert all(kernels[i] == plain for i in range(1, 12) if i not in updates), kernels
    # the re-allocation's own arithmetic (stack, top-K, counts) is a few kernels, then at most 3 per truncated layer
    for i in (3, 7):
        assert kernels[i] - plain <= 8 + 3 * updates[i], (i, kernels[i], plain)
    # the last layer: the session's own end of prefill (as FullKV's), the last re-allocation, and finish_prefill
    # storing every layer in position order again (a sort and a gather of keys, values and positions)
    assert kernels[11] - plain <= (full[11] - full[1]) + 8 + 3 * 12 + 4 * 12, (kernels[11], plain, full)
    assert len(method.last_allocation) == 12 and sum(x - method.window for x in method.last_allocation) == 56 * 12


def test_the_cpu_form_loops_over_chunks(toy_llama):
    """The control: the CPU's chunked column sums (few_kernels off) launch more kernels for a longer prompt, which is
    what the counts above would show if a method fell back to them."""
    counts = []
    for n in (1024, 2048):
        ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(n))
        b = Budget.parse(128)
        with CompressionSession(toy_llama, build_method({"name": "h2o"}, b), b, few_kernels=False):
            with CountOps(is_kernel) as kernels:
                toy_llama(ids, use_cache=True)
        counts.append(kernels.count)
    assert counts[1] > counts[0]


def _reads(fn) -> int:
    tolist = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: tolist.append(1) or real(self)
    try:
        with CountOps(is_host_read) as mode:
            fn()
    finally:
        torch.Tensor.tolist = real
    return mode.count + len(tolist)


def _qkv(n=300, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g),
            torch.randn(1, hkv, n, d, generator=g))


def test_the_scoring_kernels_read_nothing_back():
    q, k, v = _qkv()
    qg = q.view(1, 2, 2, 300, 16)
    kn = F.normalize(torch.randn(3, 200, 8, dtype=torch.float64), dim=-1)
    mergeable = torch.rand(3, 200, generator=torch.Generator().manual_seed(1)) < 0.9
    anchor = torch.randint(-1, 300, (300,))
    passes = {
        "column sums (two fused kernels)": lambda: attention_and_column_sums(q, k, v, 0.25, few_kernels=True),
        "SnapKV window attention": lambda: window_attention(q, k, 8, 0.25),
        "CaM merge probabilities": lambda: cam_ops.leaving_probabilities(qg, k, 6, 10, 0.25),
        "CaM Λ output": lambda: cam_ops.masked_output(qg, k, v, 6, 10, 0.25),
        "CaM merge": lambda: cam_ops.merge_values(v.clone(), torch.rand(1, 2, 200) < 0.5, 6, 10),
        "KVMerger sets, fixed theta": lambda: device_sets(kn, mergeable, 0.75),
        "KVMerger sets, theta bisection": lambda: device_sets(kn, mergeable, 0.75, [20, 3, 50]),
        "KVMerger merge": lambda: merge_sets(k.view(-1, 16)[:300], v.view(-1, 16)[:300], torch.rand(300), anchor),
    }
    for name, fn in passes.items():
        assert _reads(fn) == 0, name


@pytest.mark.parametrize("name", sorted(scorer_names()))
def test_no_scorer_reads_the_device(name):
    """Every method's per-entry prefill scores (the interface AdaKV and ChunkKV select through) take no host read."""
    q, k, v = _qkv(n=64)
    layer = make_layer(k, v)
    ctx = prefill_ctx(q, layer, 16)
    ctx.rope_inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    ctx.few_kernels = True
    ctx.host_ints()  # what the session hands over
    fields = {"window": 8} if name in ("snapkv", "pyramidkv") else {"mode": "whole_prompt"} if name == "keydiff" else {}
    method = METHODS.build(name, fields)
    method.validate(Budget.parse(16))
    assert _reads(lambda: method.prefill_scores(layer, ctx)) == 0


@pytest.mark.parametrize("name", sorted(scorer_names()))
@pytest.mark.parametrize("n", [7, 8, 9, 64])
def test_a_declared_must_keep_count_is_the_scores(name, n):
    """Where a scorer says on the host how many entries its scores mark +inf (``Method.must_keep_count``: AdaKV and
    ChunkKV then skip reading it), that is the count in every head, for prompts shorter than, as long as and longer
    than SnapKV's window of 8, in both granularities; AdaKV's and ChunkKV's selections are the same either way."""
    from kvbench.methods.adakv import adakv_keep_official
    from kvbench.methods.chunkkv import chunk_keep_counted

    for granularity in ("kv_head", "query_head"):
        q, k, v = _qkv(n=n)
        layer = make_layer(k, v)
        ctx = prefill_ctx(q, layer, 4)
        ctx.rope_inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        fields = {"window": 8} if name in ("snapkv", "pyramidkv") else {"mode": "whole_prompt"} if name == "keydiff" \
            else {}
        method = METHODS.build(name, fields)
        if "granularity" in {f for f in vars(method)}:
            method.granularity = granularity
        declared = method.must_keep_count(n)
        if declared is None:
            return  # this scorer says nothing: the wrappers read the count
        scores = method.prefill_scores(layer, ctx)
        per_head = (scores == float("inf")).sum(-1)
        assert per_head.tolist() == [[declared] * scores.shape[1]], (granularity, per_head)
        for cap in (declared + 2, n):
            assert torch.equal(adakv_keep_official(scores[0], cap, 0.2, declared),
                               adakv_keep_official(scores[0], cap, 0.2))
            assert [t.tolist() if isinstance(t, torch.Tensor) else t for t in chunk_keep_counted(
                scores[0], cap, 2, declared)] == [t.tolist() if isinstance(t, torch.Tensor) else t
                                                   for t in chunk_keep_counted(scores[0], cap, 2)]
    assert name in ("snapkv", "pyramidkv")  # the scorers that declare it


# ---- KVMerger: the device's sets are the host scan's ---------------------------------------------------------------
def _smooth(g, n, d):
    """Keys that drift slowly with jumps: runs of similar keys at theta 0.75, sets of many lengths."""
    steps = torch.randn(n, d, generator=g) * 0.35
    jumps = (torch.rand(n, 1, generator=g) < 0.12).float() * torch.randn(n, d, generator=g) * 3
    return torch.cumsum(steps + jumps, 0)


@pytest.mark.parametrize("enforce", [False, True])
def test_device_sets_are_the_host_scans(enforce):
    """``device_sets`` = ``merging_sets`` on every run (fixed theta) and = ``KVMerger._partition``'s bisection, step
    for step (the same theta), on 40 random partitions of random lengths and rooms."""
    g = torch.Generator().manual_seed(7 + enforce)
    method = KVMerger()
    method.validate(Budget.parse(64 if enforce else 0.5))
    for _ in range(10):
        n = int(torch.randint(5, 160, (1,), generator=g))
        kn = F.normalize(torch.stack([_smooth(g, n, 8) for _ in range(4)]).double(), dim=-1)
        mergeable = torch.rand(4, n, generator=g) < 0.85
        rooms = [int(torch.randint(1, max(2, n // 3), (1,), generator=g)) for _ in range(4)]
        anchors, thetas = device_sets(kn, mergeable, 0.75, rooms if enforce else None)
        for p in range(4):
            runs = runs_of(np.nonzero(mergeable[p].numpy())[0])
            sets, theta = method._partition(kn[p].numpy(), runs, rooms[p], enforce)
            assert anchors[p].nonzero().view(-1).tolist() == sorted(hi for _, hi in sets)
            assert float(thetas[p]) == theta


def test_device_sets_in_passes_and_at_theta_exactly(monkeypatch):
    """Passes of a few sequences give the same sets; a pair at exactly theta does not merge (strict >), as on the
    host (tests/test_method_kvmerger.py::test_a_pair_exactly_at_theta_does_not_merge)."""
    from kvbench.methods import kvmerger_ops

    keys = torch.zeros(10, 8)
    for i in range(7):
        keys[i, i + 1] = 1.0
    keys[7] = torch.tensor([3.0, 1, 1, 1, 1, 1, 1, 1]) / 4
    keys[8, 0] = 1.0
    kn = F.normalize(keys, dim=-1).double().expand(3, 10, 8)
    mergeable = torch.ones(3, 10, dtype=torch.bool)
    at = device_sets(kn, mergeable, 0.75)[0]
    assert at.all()  # every token its own set
    below = device_sets(kn, mergeable, 0.7499)[0]
    assert below[0].nonzero().view(-1).tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9]  # 7 merges into 8's set
    monkeypatch.setattr(kvmerger_ops, "SETS_PASS_BYTES", 48 * 10 * 10)  # one sequence per pass
    assert torch.equal(device_sets(kn, mergeable, 0.7499)[0], below)


@pytest.mark.parametrize(("budget", "fields"), [(24, {}), (24, {"shared_sets": True}), (0.5, {}),
                                                 (0.5, {"sigma_mode": "eq7", "shared_sets": True})])
def test_kvmerger_prefill_is_the_same_in_both_forms(budget, fields):
    """The whole prefill with ``few_kernels`` (device sets) equals the host scan's: kept positions, merged keys and
    values, per-layer ratios and thetas, on a left-padded batch of two."""
    g = torch.Generator().manual_seed(11)
    n, pad, hq, hkv, d = 90, 7, 4, 2, 8
    q = torch.randn(2, hq, n, d, generator=g)
    k = torch.stack([torch.stack([_smooth(g, n, d) for _ in range(hkv)]) for _ in range(2)])
    v = torch.randn(2, hkv, n, d, generator=g)
    key_valid = torch.ones(2, n, dtype=torch.bool)
    key_valid[1, :pad] = False
    caps = torch.tensor([math.ceil(budget * n), math.ceil(budget * (n - pad))]) if budget < 1 else \
        torch.tensor([budget, budget])
    results = []
    for few in (False, True):
        layer = make_layer(k, v)
        layer.set_valid(key_valid.view(2, 1, n).expand(2, hkv, n).clone())
        ctx = prefill_ctx(q, layer, caps, key_valid=key_valid)
        ctx.few_kernels = few
        method = KVMerger(**fields)
        method.validate(Budget.parse(budget))
        method.prefill(layer, ctx)
        results.append((layer, method))
    (host, host_m), (dev, dev_m) = results
    for row in range(2):
        assert kept_positions(dev, row) == kept_positions(host, row)
    assert torch.equal(dev.valid if dev.valid is not None else torch.ones_like(dev.positions, dtype=torch.bool),
                       host.valid if host.valid is not None else torch.ones_like(host.positions, dtype=torch.bool))
    torch.testing.assert_close(dev.keys, host.keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(dev.values, host.values, rtol=0, atol=1e-6)
    assert dev_m.last_ratios == host_m.last_ratios and dev_m.last_thetas == host_m.last_thetas
    assert host_m.last_ratios[0] < 1  # something was merged
