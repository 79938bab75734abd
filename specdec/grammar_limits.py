"""What one request's grammar may cost (GrammarLimits), and the flags that set it: apart from
specdec/grammar.py so that a service's configuration imports neither llguidance nor torch, and
its --help and --version answer at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.flags import Flag


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request's grammar may cost. The fuel figures are llguidance's
    (its docs: lexer ~50k fuel per ms, mask step ~14k per ms, Earley items ~20k per ms)."""

    cache_size: int = 64  # compiled grammars kept (LRU)
    max_chars: int = 131_072  # spec text
    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000  # lexer construction at compile, ~20 ms
    step_lexer_fuel: int = 200_000  # one mask, ~14 ms
    step_max_items: int = 50_000  # Earley items in one mask, ~2.5 ms
    max_lexer_states: int = 50_000  # lexer DFA states per grammar, 1-2 kB each (llguidance's own default: 250k)

    @classmethod
    def from_config(cls, config: Any) -> "GrammarLimits":
        """From a service config with the `grammar_flags()` fields (missing ones keep the defaults)."""
        return cls(**{f: getattr(config, f"grammar_{f}") for f in cls.__dataclass_fields__
                      if hasattr(config, f"grammar_{f}")})

    def engine_limits(self) -> Any:  # llguidance.LLParserLimits
        import llguidance  # here: a service's flags parse (--help, --version) before anything heavy loads

        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, verbose_errors=False)


@dataclass(frozen=True, kw_only=True)
class GrammarConfig:
    """The grammar_* fields of a service's config (the flags of grammar_flags), for GrammarLimits.from_config;
    orchestrator and worker configs derive from it."""

    grammar_cache_size: int = GrammarLimits.cache_size
    grammar_max_chars: int = GrammarLimits.max_chars
    grammar_max_grammar_size: int = GrammarLimits.max_grammar_size
    grammar_initial_lexer_fuel: int = GrammarLimits.initial_lexer_fuel
    grammar_step_lexer_fuel: int = GrammarLimits.step_lexer_fuel
    grammar_step_max_items: int = GrammarLimits.step_max_items
    grammar_max_lexer_states: int = GrammarLimits.max_lexer_states


def grammar_flags() -> list[Flag]:
    """The flags a worker takes for its GrammarCompiler (config fields grammar_*; see GrammarLimits)."""
    d = GrammarLimits()
    return [
        Flag("--grammar-cache-size", int, d.cache_size, "compiled grammars kept per worker (LRU)"),
        Flag("--grammar-max-chars", int, d.max_chars, "longest grammar/schema text a request may send"),
        Flag("--grammar-max-grammar-size", int, d.max_grammar_size, "most symbols in a compiled grammar"),
        Flag("--grammar-initial-lexer-fuel", int, d.initial_lexer_fuel,
             "llguidance fuel for building a grammar's lexer (~50k per ms): bounds compile time"),
        Flag("--grammar-step-lexer-fuel", int, d.step_lexer_fuel, "llguidance lexer fuel per mask (~14k per ms)"),
        Flag("--grammar-step-max-items", int, d.step_max_items, "llguidance Earley items per mask (~20k per ms)"),
        Flag("--grammar-max-lexer-states", int, d.max_lexer_states, "lexer states per grammar (1-2 kB each)"),
    ]
