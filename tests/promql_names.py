"""What a PromQL expression reads: the series it selects (metric name and label matchers) and the labels it groups
by, for tests/test_dashboards.py to check the shipped dashboard and alert rules against what /metrics exports.

A tokenizer, not a full parser: strings, range and subquery brackets (`[5m]`, `[$__rate_interval]`), Grafana
variables (`$instance`, `${DS_PROMETHEUS}`) and numbers and durations are tokens of their own, so nothing inside them
is taken for a name. Then an identifier followed by `(` is a function or an aggregation (one PromQL does not know
raises: a misspelt function is an error, not a metric), `by` / `without` / `on` / `ignoring` / `group_left` /
`group_right` followed by `(` open a label list, keywords (`and`, `offset`, `bool`, ...) are skipped, an identifier
followed by `{` is a selector with matchers, and any other identifier is a bare selector.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset("sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk "
                         "limit_ratio".split())
FUNCTIONS = frozenset("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max clamp_min
cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate label_join label_replace
last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector
year
""".split()) | AGGREGATIONS
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<var>\$\{[^}]*\}|\$\w+)
  | (?P<number>(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?:ms|s|m|h|d|w|y)*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|.)""", re.X | re.S)


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value without quotes)


@dataclass
class Reads:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # every label named in by / without / on / ignoring / group_*


def tokens(expr: str) -> list[tuple[str, str]]:
    return [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup != "space"]


def reads(expr: str) -> Reads:
    """The selectors and grouping labels of one PromQL expression; ValueError on an unknown function, unbalanced
    parentheses, a selector without a metric name or a malformed matcher list."""
    toks, out, i = tokens(expr), Reads(), 0
    depth = 0
    for _, text in toks:
        depth += (text == "(") - (text == ")")
        if depth < 0:
            break
    if depth:
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in GROUPING and nxt == "(":
            end = _closing(toks, i + 1, ")")
            out.grouping |= {t for k, t in toks[i + 2:end] if k == "ident"}
            i = end + 1
        elif kind == "ident" and (nxt == "(" or (text in AGGREGATIONS and nxt in ("by", "without"))):
            if text not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {text!r} in {expr!r}")
            i += 1
        elif kind == "ident" and text in KEYWORDS:
            i += 1
        elif kind == "ident" or text == "{":
            name = text if kind == "ident" else ""
            start = i + 1 if kind == "ident" else i
            matchers: tuple[tuple[str, str, str], ...] = ()
            if start < len(toks) and toks[start][1] == "{":
                end = _closing(toks, start, "}")
                matchers = _matchers(toks[start + 1:end], expr)
                i = end + 1
            else:
                i = start
            name = name or next((v for label, op, v in matchers if label == "__name__" and op == "="), "")
            if not name:
                raise ValueError(f"a selector without a metric name in {expr!r}")
            out.selectors.append(Selector(name, matchers))
        else:
            i += 1
    return out


def _closing(toks: list[tuple[str, str]], start: int, close: str) -> int:
    for j in range(start, len(toks)):
        if toks[j][1] == close:
            return j
    raise ValueError(f"unclosed {toks[start][1]!r}")


def _matchers(toks: list[tuple[str, str]], expr: str) -> tuple[tuple[str, str, str], ...]:
    out, rest = [], [t for t in toks if t[1] != ","]
    if len(rest) % 3:
        raise ValueError(f"malformed label matchers in {expr!r}")
    for (k1, label), (_, op), (k3, value) in zip(rest[::3], rest[1::3], rest[2::3], strict=True):
        if k1 != "ident" or op not in ("=", "!=", "=~", "!~") or k3 != "string":
            raise ValueError(f"malformed label matcher {label}{op}{value} in {expr!r}")
        out.append((label, op, value[1:-1]))
    return tuple(out)
