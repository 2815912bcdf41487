"""kvbench's compressed model behind lm-evaluation-harness's model interface (``lm_eval.api.model.TemplateLM``).

Every request runs in its own ``CompressionSession`` with a fresh cache, batch size 1, greedy:

* ``loglikelihood`` (``TemplateLM.loglikelihood`` tokenizes as HFLM does: trailing context spaces move to the
  continuation, ``whole = enc(context + continuation)``, ``continuation = whole[len(enc(context)):]``; an empty
  context becomes ``[prefix_token_id]``): the context is the prefill (compressed at its end, as a prompt), then the
  continuation is fed one token per forward, each token's log-probability read before that step's eviction
  (``kvbench.engine.teacher_forcing``). HFLM's truncation ``(context + continuation)[-(max_length + 1):]`` is kept.
  Returns ``(sum of log-probabilities, every token the argmax)``, as HFLM.
* ``loglikelihood_rolling``: lm-eval's own disjoint rolling windows (``get_rolling_token_windows`` with the
  ``prefix_token_id``, ``max_length``, context 1), each scored as a loglikelihood request, summed.
* ``generate_until``: HFLM's protocol: ``normalize_gen_kwargs`` (max_gen_toks default 256), the EOS string added to
  ``until``, the context left-truncated to ``max_length - max_gen_toks``, greedy decoding with the cache
  (``greedy_generate``) that stops at EOS or once a stop string appears in the decoded tail (as HFLM's stopping
  criteria), and lm-eval's
  ``postprocess_generated_text`` (cut at the first stop string). Sampling is refused: kvbench decodes greedily.

Without a session the wrapper is plain HF inference, equal to HFLM with batch size 1 up to float arithmetic.
Per request it appends timings and cache statistics to ``self.request_stats``.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from kvbench.errors import ConfigError


def chat_template_fn(tokenizer: Any):
    """HFLM's ``apply_chat_template``: the tokenizer's template as text; without a generation prompt the last
    (assistant) message is continued."""

    def apply(chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    return apply


class KVBenchLM(TemplateLM):
    """``loaded``: a ``kvbench.models.LoadedModel``; ``new_session``: returns a fresh ``CompressionSession`` (or a
    null context for plain inference); ``max_length``: HFLM's ``max_length`` (context + generation)."""

    def __init__(self, loaded: Any, new_session: Any, max_length: int, max_gen_toks: int = 256):
        super().__init__()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.new_session = new_session
        self._max_length = max_length
        self._max_gen_toks = max_gen_toks
        self.request_stats: list[dict[str, Any]] = []

    # ---- HFLM's tokenization conventions ----
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's default special tokens, none when the string already starts with the prefix token."""
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return chat_template_fn(self.tokenizer)(chat_history, add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    # ---- requests ----
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from kvbench.engine.teacher_forcing import teacher_forced_logprobs

        results = []
        for _, context_enc, continuation_enc in requests:
            if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
                raise ValueError(f"loglikelihood needs a context, a continuation and at most max_length="
                                 f"{self.max_length} continuation tokens (got {len(context_enc)}, "
                                 f"{len(continuation_enc)})")
            ids = (context_enc + continuation_enc)[-(self.max_length + 1):]
            prefill = len(ids) - len(continuation_enc)
            with self.new_session() as session:
                out = teacher_forced_logprobs(self.loaded.model, ids, prefill, score_from=prefill)
            self._record(session, prefill, 0, out.prefill_seconds, out.decode_seconds, out.decode_steps,
                         out.resident_kv_bytes_final)
            results.append((float(out.logprobs.double().sum()), bool(out.greedy.all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (string,) in [req.args for req in requests]:
            windows = [
                ((None,), *lm_utils.make_disjoint_window(window))
                for window in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            totals.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from kvbench.engine.generate import greedy_generate

        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        outputs = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ConfigError(f"kvbench decodes greedily; this lm-eval task asks for sampling ({gen_kwargs})")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ConfigError(f"max_gen_toks={max_gen_toks} must be below max_length={self.max_length}")
            context_enc = self._encode_context(context)[-(self.max_length - max_gen_toks):]

            tail = max((len(stop) for stop in until), default=0) + 8  # tokens that can hold a new stop string

            def should_stop(row: int, tokens: list[int], until=until, tail=tail) -> bool:
                text = self.tokenizer.decode(tokens[-tail:])
                return any(stop and stop in text for stop in until)

            with self.new_session() as session:
                out = greedy_generate(self.loaded.model, [context_enc], max_gen_toks, self.loaded.eos_token_ids,
                                      self.tokenizer.pad_token_id, should_stop)
            self._record(session, len(context_enc), len(out.tokens[0]), out.prefill_seconds, out.decode_seconds,
                         out.decode_steps, out.resident_kv_bytes_final)
            text = self.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            outputs.append(postprocess_generated_text(generation=text, stop=until, think_end_token=None))
        return outputs

    def _encode_context(self, context: str) -> list[int]:
        """HFLM ``tok_batch_encode``: no special tokens when the context starts with the BOS string, else the
        tokenizer's default."""
        bos = getattr(self.tokenizer, "bos_token", None)
        special = {"add_special_tokens": False} if bos and context.startswith(bos) else {}
        return self.tokenizer(context, **special).input_ids

    def _record(self, session: Any, prompt_tokens: int, new_tokens: int, prefill_s: float, decode_s: float,
                steps: int, final_bytes: int) -> None:
        stats = getattr(session, "stats", None)
        self.request_stats.append({
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "prefill_seconds": prefill_s,
            "decode_seconds": decode_s,
            "decode_steps": steps,
            "resident_kv_bytes": stats.resident_kv_bytes_after_prefill if stats else 0,
            "resident_kv_bytes_final": final_bytes,
            "layer_entries": stats.layer_entries_after_prefill if stats else [],
            "attended_tokens_mean": round(stats.attended_tokens_mean, 2) if stats else 0.0,
        })


__all__ = ["KVBenchLM", "chat_template_fn"]
