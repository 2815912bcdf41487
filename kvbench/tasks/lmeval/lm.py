"""kvbench's compressed model behind lm-evaluation-harness's model interface (``lm_eval.api.model.TemplateLM``).

Every request is sent to the job's ``Answerer`` (``kvbench.tasks.requests``), which runs it in its own session of the
job's method and budget with a fresh cache, batch size 1, greedy:

* ``loglikelihood`` (``TemplateLM.loglikelihood`` tokenizes as HFLM does: trailing context spaces move to the
  continuation, ``whole = enc(context + continuation)``, ``continuation = whole[len(enc(context)):]``; an empty
  context becomes ``[prefix_token_id]``): the context is the prefill (compressed at its end, as a prompt), then the
  continuation is fed one token per forward, each token's log-probability read before that step's eviction
  (a ``TeacherForced`` request). HFLM's truncation ``(context + continuation)[-(max_length + 1):]`` is kept.
  Returns ``(sum of log-probabilities, every token the argmax)``, as HFLM.
* ``loglikelihood_rolling``: lm-eval's own disjoint rolling windows (``get_rolling_token_windows`` with the
  ``prefix_token_id``, ``max_length``, context 1), each scored as a loglikelihood request, summed.
* ``generate_until``: HFLM's protocol: ``normalize_gen_kwargs`` (max_gen_toks default 256), the EOS string added to
  ``until``, the context left-truncated to ``max_length - max_gen_toks``, greedy decoding with the cache
  (a ``GenerateUntil`` request) that stops at EOS or once a stop string appears in the decoded tail (as HFLM's
  stopping criteria), and lm-eval's ``postprocess_generated_text`` (cut at the first stop string). Sampling is
  refused: kvbench decodes greedily.

With FullKV the wrapper is plain HF inference, equal to HFLM with batch size 1 up to float arithmetic.
Per request it appends timings and cache statistics to ``self.request_stats``.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from kvbench.errors import ConfigError
from kvbench.tasks.requests import Answerer, AnswerStats, GenerateUntil, TeacherForced


def chat_template_fn(tokenizer: Any):
    """HFLM's ``apply_chat_template``: the tokenizer's template as text; without a generation prompt the last
    (assistant) message is continued."""

    def apply(chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    return apply


class KVBenchLM(TemplateLM):
    """``answerer``: the job's ``kvbench.tasks.requests.Answerer`` (the job runner's, which answers each request with
    the engine under the job's method and budget); ``max_length``: HFLM's ``max_length`` (context + generation)."""

    def __init__(self, answerer: Answerer, max_length: int, max_gen_toks: int = 256):
        super().__init__()
        self.answerer = answerer
        self.tokenizer = answerer.tokenizer
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
        results = []
        for _, context_enc, continuation_enc in requests:
            if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
                raise ValueError(f"loglikelihood needs a context, a continuation and at most max_length="
                                 f"{self.max_length} continuation tokens (got {len(context_enc)}, "
                                 f"{len(continuation_enc)})")
            ids = (context_enc + continuation_enc)[-(self.max_length + 1):]
            prefill = len(ids) - len(continuation_enc)
            out = self.answerer.loglikelihood(TeacherForced(tuple(ids), prefill, score_from=prefill))
            self._record(out.stats, prefill, 0)
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
            out = self.answerer.generate(GenerateUntil((tuple(context_enc),), max_gen_toks, tuple(until), tail))
            self._record(out.stats, len(context_enc), len(out.tokens[0]))
            text = self.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            outputs.append(postprocess_generated_text(generation=text, stop=until, think_end_token=None))
        return outputs

    def _encode_context(self, context: str) -> list[int]:
        """HFLM ``tok_batch_encode``: no special tokens when the context starts with the BOS string, else the
        tokenizer's default."""
        bos = getattr(self.tokenizer, "bos_token", None)
        special = {"add_special_tokens": False} if bos and context.startswith(bos) else {}
        return self.tokenizer(context, **special).input_ids

    def _record(self, stats: AnswerStats, prompt_tokens: int, new_tokens: int) -> None:
        self.request_stats.append({
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            **stats.record_fields(),
        })


__all__ = ["KVBenchLM", "chat_template_fn"]
