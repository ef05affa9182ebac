"""SGLang's STANDALONE speculative decoding (topk 1, greedy) re-done in plain transformers, to
predict a live server's speculation counters exactly.

SGLang runs a standalone draft through EAGLE's code (EAGLEWorkerV2): the draft's extend passes
take the target's input ids rotated left by one (`_draft_extend_for_prefill`: the last prompt
token's slot gets the target's first output token; decode-time draft extends take the verified
predictions). The draft's KV slot for position p therefore holds token p + 1, so the draft
never sees the sequence's first token: it proposes the greedy continuation of
`committed[1:]`. With draft = target its proposals differ from the target's whenever that
first token matters, which on a tiny random model is often (acceptance well below 1).

Each round: the draft proposes num_steps tokens greedily from committed[1:]; the target
accepts the longest prefix that equals its own greedy choices and adds its bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecTrace:
    output_ids: list[int]
    verify_ct: int
    num_correct_drafts: int
    num_proposed_drafts: int

    @property
    def accept_rate(self) -> float:
        return self.num_correct_drafts / max(1, self.num_proposed_drafts)


def _next_token(model, ids: list[int]) -> int:
    with torch.inference_mode():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def standalone_greedy(target, draft, prompt: list[int], max_new_tokens: int,
                      num_steps: int) -> SpecTrace:
    committed = list(prompt) + [_next_token(target, prompt)]  # the prefill's token
    verify_ct = correct = proposed = 0
    while len(committed) - len(prompt) < max_new_tokens:
        drafts: list[int] = []
        for _ in range(num_steps):
            drafts.append(_next_token(draft, committed[1:] + drafts))
        k = 0
        while k < num_steps and _next_token(target, committed + drafts[:k]) == drafts[k]:
            k += 1
        bonus = _next_token(target, committed + drafts[:k])
        committed += drafts[:k] + [bonus]
        verify_ct, correct, proposed = verify_ct + 1, correct + k, proposed + num_steps
    return SpecTrace(committed[len(prompt) :][:max_new_tokens], verify_ct, correct, proposed)
