"""Reference speculative decoder: a DSpark drafter against a transformers target.

Each step drafts a block from the target's hidden states (Markov-sequential sampling),
optionally trims it with the prefix scheduler, and verifies it with one target forward over
[anchor, drafts]. It exists to measure acceptance (τ) exactly as vLLM counts it and to prove
losslessness; it serves one request at a time and is not a serving engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model import ContextCache, DSparkDrafter
from .scheduler import StepRateTable, schedule_prefixes
from .targets import capture_hidden_states
from .verify import verify_block, verify_greedy, verify_standard

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")


class TargetSession:
    """One sequence on a transformers causal LM with a KV cache, exporting hidden states."""

    def __init__(self, model, layer_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.model, self.layer_ids = model, layer_ids
        self.cache = DynamicCache()
        self.length = 0
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids`; return their logits `[n, V]` (fp32) and hidden states `[n, layers, H]`."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self.layer_ids:
            with capture_hidden_states(self.model, self.layer_ids) as cap:
                out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True)
            hidden = torch.stack([cap[i][0] for i in self.layer_ids], dim=1)
        else:
            out, hidden = self.model(input_ids=x, past_key_values=self.cache, use_cache=True), None
        self.length += len(ids)
        return out.logits[0].float(), hidden

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: drop that many tokens
            self.length = length


class TargetBatch:
    """Several sequences on one transformers KV cache, fed side by side.

    Every call appends the same number of cache columns to every row (shorter rows are padded);
    a column a row does not keep (its padding, a rejected draft) stays in the cache, masked out
    of all later attention, and positions are given per row, so rows of different lengths never
    need cropping to different lengths. Rows are dropped (`select`) when their sequence ends.
    """

    PAD_ID = 0  # what padding columns hold: never attended to

    def __init__(self, model, layer_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.model, self.layer_ids = model, layer_ids
        self.cache = DynamicCache()
        self.device = next(model.parameters()).device
        self.mask: torch.Tensor | None = None  # [rows, columns] bool: columns each row attends to
        self.lengths: torch.Tensor | None = None  # [rows] tokens each row holds
        self.width = 0  # columns appended by the last `run`

    @torch.no_grad()
    def run(self, rows: list[list[int]], logits_at: list[int] | None = None):
        """Append each row's tokens; return logits `[rows, W, V]` (fp32; with `logits_at`, only
        each row's logits at that index, `[rows, V]`) and hidden states `[rows, W, layers, H]`."""
        n, w = len(rows), max(len(r) for r in rows)
        ids = torch.full((n, w), self.PAD_ID, dtype=torch.long)
        valid = torch.zeros(n, w, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[i, : len(r)] = True
        base = self.lengths if self.lengths is not None else torch.zeros(n, dtype=torch.long)
        pos = base[:, None] + torch.arange(w)
        mask = valid if self.mask is None else torch.cat([self.mask, valid], 1)
        kwargs = {}
        if logits_at is not None:  # only the columns asked for: a prefill's full logits are large
            kwargs["logits_to_keep"] = torch.tensor(sorted(set(logits_at)), device=self.device)
        with capture_hidden_states(self.model, self.layer_ids) as cap:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.long().to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=self.cache,
                use_cache=True,
                **kwargs,
            )
        hidden = torch.stack([cap[i] for i in self.layer_ids], dim=2)
        logits = out.logits.float()
        if logits_at is not None:
            col = {c: j for j, c in enumerate(sorted(set(logits_at)))}
            logits = logits[torch.arange(n), torch.tensor([col[c] for c in logits_at])]
        self.mask, self.lengths, self.width = mask, base + valid.sum(1), w
        return logits, hidden

    def keep(self, counts: list[int]) -> None:
        """Of the last call's columns, row i keeps its first `counts[i]`."""
        c = self.mask.shape[1]
        for i, k in enumerate(counts):
            self.mask[i, c - self.width + k :] = False
        self.lengths = self.mask.sum(1)

    def select(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(idx.to(self.device))
        self.mask, self.lengths = self.mask[idx], self.lengths[idx]


@dataclass
class DecodeStats:
    steps: int = 0  # target verification steps
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # steps where draft j was accepted
    drafted_at: list[int] = field(default_factory=list)  # steps where draft j was proposed

    def record(self, drafted: int, accepted: int) -> None:
        width = max(drafted, len(self.drafted_at))
        self.drafted_at += [0] * (width - len(self.drafted_at))
        self.accepted_at += [0] * (width - len(self.accepted_at))
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += int(j < accepted)
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def merge(self, other: DecodeStats) -> None:
        width = max(len(self.drafted_at), len(other.drafted_at))
        pad = lambda xs: xs + [0] * (width - len(xs))  # noqa: E731
        self.drafted_at = [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))]
        self.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted

    @property
    def tau(self) -> float:
        """Tokens emitted per verification step, bonus included (vLLM's acceptance length)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft j accepted) per verification step, as vLLM's `num_accepted_tokens_per_pos`."""
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_at]


def _pick(logits: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))


def _done(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """A sequence ends at its budget or at the first stop token it emits (as vLLM ends a
    request), even when that token was an accepted draft in the middle of a block."""
    return len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(tokens)


def _finish(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def target_generate(model, prompt_ids, max_new_tokens, stop_ids=(), temperature=0.0, generator=None) -> list[int]:
    """Plain autoregressive decoding with the same session machinery (the lossless reference)."""
    sess = TargetSession(model, [])
    logits, _ = sess.run(list(prompt_ids))
    out = [_pick(logits[-1], temperature, generator)]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits, _ = sess.run([out[-1]])
        out.append(_pick(logits[-1], temperature, generator))
    return _finish(out, max_new_tokens, set(stop_ids))


class SpeculativeDecoder:
    def __init__(
        self,
        target_model,
        drafter: DSparkDrafter,
        draft_sample_method: str = "greedy",
        rejection_sample_method: str = "standard",
        temperature: float = 0.0,
        num_speculative_tokens: int | None = None,
        step_rates: StepRateTable | None = None,
        seed: int = 0,
        verify_width: int | None = None,
    ) -> None:
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}")
        if rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}")
        if step_rates is not None and drafter.confidence_head is None:
            raise ValueError("the prefix scheduler needs a drafter with a confidence head")
        self.target, self.drafter = target_model, drafter
        self.draft_sample_method, self.rejection_sample_method = draft_sample_method, rejection_sample_method
        self.temperature = temperature
        self.k = num_speculative_tokens or drafter.config.num_speculative_tokens
        self.step_rates = step_rates
        if verify_width is not None and verify_width < 1:
            raise ValueError(f"verify_width must be at least 1 (or None: the whole block), not {verify_width}")
        self.verify_width = verify_width  # drafts per target forward in batched greedy decoding
        self.generator = torch.Generator().manual_seed(seed)
        self.n_aux = len(drafter.config.aux_layer_ids)

    @classmethod
    def from_recipe(
        cls, target_model, drafter: DSparkDrafter, spec: dict, temperature: float, **kwargs
    ) -> SpeculativeDecoder:
        """The decoder vLLM's `--speculative-config` `spec` describes (`dspark.recipe.speculative_config`):
        the same draft sampling, rejection rule and number of drafts, so τ measured here is τ of
        the recipe that is served."""
        return cls(
            target_model,
            drafter,
            spec["draft_sample_method"],
            spec["rejection_sample_method"],
            temperature,
            num_speculative_tokens=spec["num_speculative_tokens"],
            **kwargs,
        )

    def _aux(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, : self.n_aux].reshape(hidden.shape[0], -1)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=()) -> tuple[list[int], DecodeStats]:
        stop = set(stop_ids)
        stats = DecodeStats()
        sess = TargetSession(self.target, self.drafter.config.extract_layer_ids)
        logits, hidden = sess.run(list(prompt_ids))
        ctx = ContextCache(self.drafter)
        ctx.extend(self._aux(hidden))
        out = [_pick(logits[-1], self.temperature, self.generator)]
        sampled_drafts = self.draft_sample_method == "probabilistic" and self.temperature > 0
        while not _done(out, max_new_tokens, stop):
            anchor = out[-1]
            budget = min(self.k, max_new_tokens - len(out) - 1)
            prop = (
                self.drafter.propose(ctx, anchor, budget, self.temperature if sampled_drafts else 0.0, self.generator)
                if budget > 0
                else None
            )
            drafts = prop.tokens if prop is not None else torch.zeros(0, dtype=torch.long)
            if prop is not None and self.step_rates is not None and drafts.numel():
                keep = schedule_prefixes([prop.confidence], self.step_rates)[0]
                drafts = drafts[:keep]
            start = sess.length
            logits, hidden = sess.run([anchor, *drafts.tolist()])
            if self.temperature <= 0:
                n, nxt = verify_greedy(drafts, logits)
            else:
                p = torch.softmax(logits / self.temperature, -1)
                if sampled_drafts and drafts.numel():
                    q = prop.probs[: drafts.numel()]
                else:
                    q = torch.nn.functional.one_hot(drafts, p.shape[-1]).float()
                verify = verify_block if self.rejection_sample_method == "block" else verify_standard
                n, nxt = verify(drafts, q, p, self.generator)
            sess.crop(start + n + 1)
            ctx.extend(self._aux(hidden[: n + 1]))
            stats.record(drafts.numel(), n)
            out += [*drafts[:n].tolist(), nxt]
        return _finish(out, max_new_tokens, stop), stats

    @torch.no_grad()
    def generate_many(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids=(),
        max_batch_tokens: int = 4096,
        max_batch_rows: int = 16,
    ) -> list[tuple[list[int], DecodeStats]]:
        """`generate` for several prompts. Greedy decoding runs them in batches of similar
        length (at most `max_batch_rows` rows and `max_batch_tokens` padded prompt tokens, which
        bounds the prefill's memory): one drafter pass and one target forward per step for the
        whole batch, `verify_width` drafts of each block per forward (`_generate_batch`).
        Sampling decodes one prompt at a time."""
        if self.temperature > 0:
            return [self.generate(p, max_new_tokens, stop_ids) for p in prompts]
        results: list = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        chunk: list[int] = []
        for i in order + [None]:
            # sorted by length: the newest prompt is the longest, and sets the padded width
            if chunk and (
                i is None or len(chunk) == max_batch_rows or (len(chunk) + 1) * len(prompts[i]) > max_batch_tokens
            ):
                for j, r in zip(
                    chunk, self._generate_batch([prompts[j] for j in chunk], max_new_tokens, set(stop_ids))
                ):
                    results[j] = r
                chunk = []
            if i is not None:
                chunk.append(i)
        return results

    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int, stop: set[int]):
        """Greedy decoding of a batch. A row's block of drafts is verified `verify_width` drafts
        per target forward (all of them when it is None): a greedy block is accepted up to its
        first draft that is not the target's argmax, so checking the rest only once a prefix
        survived accepts exactly what one forward over the whole block would, and a block that
        fails early (most do) costs the target 1 + `verify_width` positions instead of 1 + k.
        A row whose prefix survived goes on with the rest of its block at the next forward,
        beside rows that verify new blocks; its drafter is not called until the block ends.
        Statistics count blocks, as the one-forward-per-block decoder does."""
        n, w = len(prompts), self.verify_width
        stats = [DecodeStats() for _ in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        ctxs = [ContextCache(self.drafter) for _ in prompts]
        left: list[list[int] | None] = [None] * n  # the open block's drafts not verified yet
        block: list[list[int]] = [[0, 0] for _ in prompts]  # the open block's drafted, accepted
        batch = TargetBatch(self.target, self.drafter.config.extract_layer_ids)
        logits, hidden = batch.run([list(p) for p in prompts], logits_at=[len(p) - 1 for p in prompts])
        for i, p in enumerate(prompts):
            ctxs[i].extend(self._aux(hidden[i, : len(p)]))
            outs[i].append(int(logits[i].argmax()))
        active = list(range(n))
        while True:
            still = [j for j, i in enumerate(active) if left[i] is not None or not _done(outs[i], max_new_tokens, stop)]
            if len(still) < len(active):
                active = [active[j] for j in still]
                if not active:
                    break
                batch.select(still)
            new = [i for i in active if left[i] is None]
            if new:
                budgets = [min(self.k, max_new_tokens - len(outs[i]) - 1) for i in new]
                props = self.drafter.propose_batch([ctxs[i] for i in new], [outs[i][-1] for i in new], budgets)
                drafts = [p.tokens for p in props]
                if self.step_rates is not None:
                    # Algorithm 1 over the whole batch: the verification budget goes where survival is highest.
                    rows = [j for j, d in enumerate(drafts) if d.numel()]
                    for j, keep in zip(rows, schedule_prefixes([props[j].confidence for j in rows], self.step_rates)):
                        drafts[j] = drafts[j][:keep]
                for i, d in zip(new, drafts):
                    left[i], block[i] = d.tolist(), [d.numel(), 0]
            chunks = {i: left[i][:w] if w is not None else left[i] for i in active}
            logits, hidden = batch.run([[outs[i][-1], *chunks[i]] for i in active])
            kept = []
            for j, i in enumerate(active):
                c = chunks[i]
                m, nxt = verify_greedy(torch.tensor(c, dtype=torch.long), logits[j, : len(c) + 1])
                ctxs[i].extend(self._aux(hidden[j, : m + 1]))
                outs[i] += c[:m]
                block[i][1] += m
                kept.append(m + 1)
                rest = left[i][len(c) :]
                if m == len(c) and rest and rest[0] == nxt:
                    # the next draft is the target's token: accepted, and verification goes on from it
                    outs[i].append(nxt)
                    block[i][1] += 1
                    left[i] = rest[1:]
                    continue
                outs[i].append(nxt)
                stats[i].record(*block[i])
                left[i] = None
            batch.keep(kept)
        return [(_finish(o, max_new_tokens, stop), st) for o, st in zip(outs, stats)]


@torch.no_grad()
def greedy_mismatches(model, prompt_ids: list[int], output: list[int]) -> list[int]:
    """Positions of `output` where the token is not the target's argmax given everything before
    it: one teacher-forced forward over prompt + output instead of a second greedy decode. An
    output with none is what greedy decoding produces (up to exact ties), so this checks
    losslessness. The last token may be a stop token or the budget's end; both are checked."""
    return greedy_mismatches_many(model, [prompt_ids], [output])[0]


@torch.no_grad()
def greedy_mismatches_many(
    model, prompts: list[list[int]], outputs: list[list[int]], max_rows: int = 8, max_batch_tokens: int = 8192
) -> list[list[int]]:
    """`greedy_mismatches` of several outputs, up to `max_rows` teacher-forced sequences and
    `max_batch_tokens` padded tokens per forward (a masked forward pays for every padded
    position, quadratically in attention: 8 rows padded to a 7K-token prompt took 317 s on 2
    cores, one row at a time a fraction of it). Rows are left-padded (masked, positions per
    row), so every output ends at the last column and one `logits_to_keep` covers them all;
    rows are grouped by length to pad little."""
    dev = next(model.parameters()).device
    found: list[list[int]] = [[] for _ in prompts]
    order = sorted((i for i in range(len(prompts)) if outputs[i]), key=lambda i: len(prompts[i]) + len(outputs[i]))
    batches: list[list[int]] = []
    for i in order:  # sorted by length: the newest row is the longest and sets the padded width
        width = len(prompts[i]) + len(outputs[i]) - 1
        if batches and len(batches[-1]) < max_rows and (len(batches[-1]) + 1) * width <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    for rows in batches:
        seqs = [[*prompts[i], *outputs[i][:-1]] for i in rows]
        width, keep = max(map(len, seqs)), max(len(outputs[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, seq in enumerate(seqs):
            ids[r, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[r, width - len(seq) :] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=pos.to(dev),
            use_cache=False,
            logits_to_keep=keep,
        ).logits
        for r, i in enumerate(rows):
            best = logits[r, keep - len(outputs[i]) :].float().argmax(-1).tolist()
            found[i] = [j for j, (a, b) in enumerate(zip(outputs[i], best)) if a != b]
    return found


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t0
