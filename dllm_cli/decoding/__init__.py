"""The decoding engine: canvas, sampling, unmasking rules, cache policies and the loop.

    run = decode_steps(model, special, prompts, settings)  # iterate for StepEvents (no prints)
    for event in run: ...
    result = run.result()                  # or: decode(model, special, prompts, settings)

Choices worth knowing (details in each module):
- Blocks and steps that do not divide are adjusted, not refused (settings.py, canvas.py).
- Every policy predicts the block from fresh hidden states, shifting the window one column
  left for Dream; no block's first token is ever force-committed (Fast-dLLM issue #61).
- FreeCache recomputes a finished block once, from its final tokens, on the next block's first
  step, then never again (policies.py).
- Classifier-free guidance decodes the prompt-masked branch as extra batch rows with their own
  cache rows, so it composes with every cache policy (engine.py).
- [MASK] is never a draft and logits past the real vocabulary are ignored (sampling.py).
- Every row keeps its own place (rows.py) and a step serves all rows with at most two forwards
  (forwards.py); unguided static batches move through the blocks in lockstep.
- Continuous batching (continuous.py): `ContinuousRun(decoder, prompts, slots, on_done,
  on_error)` keeps `slots` rows decoding, each new prompt taking a finished row's slot and KV
  cache row on the next step; answers equal single-prompt decodes under greedy decoding.
- Guided diffusion (FlashDLM) is a frontier-walking committer: `GuidedCommitter(guide, vocab,
  special, GuideRules(...))` passed as `committer=`; each row is written left to right from its
  first mask, an AR guide verifying the drafts in chunks (guided.py says exactly how).
- A DiffusionGemma model (uniform-state block diffusion) is decoded by transformers' own
  `generate` behind the same run interface; its events carry `drafts` (tokens replaced) as
  well as commits (gemma.py, gemma_stream.py).
- Dream's `fixed` schedule counts each row's own masks (Dream averages over the batch), so a
  row never depends on its batch; confidence ties go to the leftmost column.
"""

from dllm_cli.decoding.answer import answer_end, answer_length, answer_tokens, first_stop
from dllm_cli.decoding.engine import Decoder, DecodeRun, decode, decode_steps
from dllm_cli.decoding.events import (
    DecodeResult,
    RowCommit,
    RowPhase,
    StepEvent,
)
from dllm_cli.decoding.guided import GuidedCommitter
from dllm_cli.decoding.unmask import Committer, Decision, StepContext

__all__ = [
    "Committer",
    "Decision",
    "DecodeResult",
    "DecodeRun",
    "Decoder",
    "GuidedCommitter",
    "RowCommit",
    "RowPhase",
    "StepContext",
    "StepEvent",
    "answer_end",
    "answer_length",
    "answer_tokens",
    "decode",
    "decode_steps",
    "first_stop",
]
