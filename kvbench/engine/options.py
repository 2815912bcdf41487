"""Engine options that configs are validated against (kept free of torch/transformers imports)."""

#: "original": kept keys keep their RoPE positions (what the papers do); "compact": keys are re-rotated as if the
#: cache were contiguous, just before the next query (StreamingLLM's pos-shift).
POSITION_MODES = ("original", "compact")
