"""Structured outputs in LLMEngine: the grammar machinery, built with the first structured request or by a loader
on its own thread (start_grammar_load), and the structured requests held while that loader builds (`_held`, started
by the first step after it is done). A mixin of LLMEngine: start_grammar_load is called on the engine by
pool_worker.worker, prepare_grammar by tests (and by _grammar_row); the rest by LLMEngine's add_request and step and
by engine.handoff_blocks.
Relies on LLMEngine's state and on abort (LLMEngine) and _start_prefilled (engine.handoff_blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import Request, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput

if TYPE_CHECKING:
    import torch

    from engine.core.scheduler import Scheduler
    from engine.engine_config import EngineConfig
    from engine.model.model_config import ModelConfig
    from engine.runner.model_runner import ModelRunner
    from engine.sampling.grammar import GrammarManager
    from engine.sampling.grammar_loader import GrammarLoader
    from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A structured request that arrived while its grammar's loader was building (LLMEngine.start_grammar_load):
    add_request's (`first` None: it holds nothing) or add_prefilled_request's (its first token; it keeps its booked
    blocks). Started, in arrival order, by the first step after the loader is done."""

    req: Request
    first: tuple[int, TokenLogprob | None] | None = None


class GrammarHolding:
    """LLMEngine's structured-output machinery and its held requests (see the module)."""

    # LLMEngine's, set in its __init__
    config: EngineConfig
    device: torch.device
    model_config: ModelConfig
    tokenizer: Tokenizer
    scheduler: Scheduler
    runner: ModelRunner
    grammar: GrammarManager | None
    grammar_loader: GrammarLoader | None
    _held: dict[str, _Held]

    def start_grammar_load(self, on_ready: Callable[[], None] | None = None,
                           tokenizer: Callable[[], Tokenizer] | None = None) -> GrammarLoader:
        """Build the structured-output machinery on a thread of its own (engine.sampling.grammar_loader), from
        any thread; `on_ready()` is called on that thread when it ends. Structured requests that arrive meanwhile
        are held, the others step on. Once only: a later call returns the first loader, `on_ready` now its callback
        (called at once if the build has ended). `tokenizer`: where the build gets the tokenizer (LLMEngine's start,
        before self.tokenizer is set); None: self.tokenizer."""
        from engine.sampling.grammar_loader import GrammarLoader

        if self.grammar_loader is None:
            self.grammar_loader = GrammarLoader(lambda: self._build_grammar(tokenizer() if tokenizer else None),
                                                on_ready)
        elif on_ready is not None:
            self.grammar_loader.notify(on_ready)
        return self.grammar_loader

    def prepare_grammar(self) -> bool:
        """Build the structured-output machinery now, on this thread (False: llguidance is not installed), unless
        a loader builds it (start_grammar_load: then True once it is done). Built with the first structured request
        of an engine without a loader (an offline LLM)."""
        if self.grammar is None:
            if self.grammar_loader is not None:
                try:
                    self.grammar = self.grammar_loader.manager()
                except ImportError:
                    return False
                except Exception as e:  # a refusal, as add_request's are: the request fails, the engine goes on
                    raise ValueError(f"structured outputs are unavailable here: the grammar tables failed to build "
                                     f"({type(e).__name__}: {e})") from e
                return self.grammar is not None
            try:
                self.grammar = self._build_grammar()
            except ImportError:
                return False
        return True

    def _build_grammar(self, tokenizer: Tokenizer | None = None) -> GrammarManager:
        from engine.sampling.grammar import GrammarManager  # llguidance: only where outputs are structured

        return GrammarManager((tokenizer or self.tokenizer).to_json(), self.model_config.vocab_size,
                              self.model_config.eos_token_ids, self.device, self.config.max_num_seqs)

    def _grammar_pending(self, params: SamplingParams) -> bool:
        """A structured request must wait: its grammar's loader is still building."""
        return (params.structured is not None and self.grammar is None and self.grammar_loader is not None
                and not self.grammar_loader.done())

    def _admit_held(self) -> list[StepOutput]:
        """Start the held structured requests once their loader is done, in arrival order; one whose grammar
        cannot be made (the loader failed, its spec does not compile, its prior outputs break it) ends with
        finish_reason "error", its blocks freed."""
        if not self._held or not self.grammar_loader.done():
            return []
        outputs = []
        for rid, held in list(self._held.items()):
            del self._held[rid]
            try:
                if held.first is None:
                    grammar = self._grammar_row(rid, held.req.params, held.req.prior_output_ids)
                    self.scheduler.add(held.req)
                    self.grammar.attach(rid, grammar, held.req.incarnation)
                    continue
                out = self._start_prefilled(held.req, *held.first)
            except Exception as e:  # noqa: BLE001 - the request ends; the engine steps on
                log.warning("request %s: its structured output cannot start: %s", rid, e)
                self.abort(rid)
                out = StepOutput(rid, [], [], "error", prefill_only=held.req.prefill_only)
            if out is not None:
                outputs.append(out)
        return outputs

    def _grammar_row(self, request_id: str, params: SamplingParams, outputs: Sequence[int],
                     last_may_fail: bool = False):
        """The request's grammar matcher, having consumed the outputs it has (None without a structured spec;
        GrammarManager.make)."""
        if params.structured is None:
            return None
        if not self.prepare_grammar():
            raise ValueError("structured outputs need the llguidance package, which is not installed")
        self.runner.logits_hook = self.grammar.constrain  # only once a request is constrained: none cost nothing
        return self.grammar.make(request_id, params.structured, outputs, last_may_fail)
