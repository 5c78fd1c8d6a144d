"""``agentrl/SearchQA-v0``: multi-hop questions over a generated encyclopedia.

A fictional world (people, cities, countries, companies; invented names, so a
model cannot answer from memory) is generated from ``corpus_seed``: one document
per entity. Each question needs two or three documents, found with the
``search`` tool (BM25 via ``bm25s``): "In which country was Mira Tolvane
born?" needs Mira's page (born in Kessa) and Kessa's page (in Varnland).

The model ends with ``Answer: <text>``. Reward: exact match of the normalized
answer (``metric="em"``, default) or token F1 (``metric="f1"``); ``info`` on the
last step reports both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from agentrl.tools import Document, SearchTool, Task

from .._settings import one_of, whole
from ._common import answer_f1, extract_answer, normalize_answer
from .base import ToolTaskEnv

__all__ = ["SearchQAEnv", "World", "make_world"]

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "kr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "n", "r", "s", "l", "th", "nd", "sk"]
PROFESSIONS = ["chemist", "painter", "engineer", "composer", "surgeon", "architect", "poet"]
INDUSTRIES = ["shipbuilding", "software", "textiles", "pharmaceuticals", "optics", "tea"]


def _word(r: random.Random, syllables: int) -> str:
    parts = [r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + r.choice(_CODAS)).capitalize()


@dataclass
class World:
    """The generated facts and the documents that state them."""

    countries: list[str] = field(default_factory=list)
    city_country: dict[str, str] = field(default_factory=dict)
    person_city: dict[str, str] = field(default_factory=dict)
    person_company: dict[str, str] = field(default_factory=dict)
    company_city: dict[str, str] = field(default_factory=dict)
    company_founder: dict[str, str] = field(default_factory=dict)
    documents: list[Document] = field(default_factory=list)


def _unique(r: random.Random, n: int, make: Any, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = make()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def make_world(seed: int = 0, people: int = 60, cities: int = 16, countries: int = 6) -> World:
    """A world of ``people`` people, ``cities`` cities and ``countries`` countries."""
    r = random.Random(seed)
    taken: set[str] = set()
    w = World()
    w.countries = _unique(r, countries, lambda: _word(r, 2) + "land", taken)
    city_names = _unique(r, cities, lambda: _word(r, 2), taken)
    person_names = _unique(r, people, lambda: f"{_word(r, 2)} {_word(r, 3)}", taken)
    companies = _unique(
        r,
        max(4, people // 5),
        lambda: f"{_word(r, 2)} {r.choice(['Works', 'Group', 'Labs'])}",
        taken,
    )
    w.city_country = {c: r.choice(w.countries) for c in city_names}
    w.person_city = {p: r.choice(city_names) for p in person_names}
    founders = r.sample(person_names, len(companies))
    w.company_founder = dict(zip(companies, founders, strict=True))
    w.company_city = {c: r.choice(city_names) for c in companies}
    w.person_company = {p: r.choice(companies) for p in person_names}
    docs = []
    for p in person_names:
        prof = r.choice(PROFESSIONS)
        founded = [c for c, f in w.company_founder.items() if f == p]
        text = (
            f"{p} is {'an' if prof[0] in 'aeiou' else 'a'} {prof}. {p} was born in {w.person_city[p]}. "
            f"{p} works for {w.person_company[p]}."
        )
        if founded:
            text += f" {p} founded {founded[0]}."
        docs.append(Document(text=text, title=p, id=f"person:{p}"))
    for c in city_names:
        text = f"{c} is a city in {w.city_country[c]}. It lies on the {_word(r, 2)} river."
        docs.append(Document(text=text, title=c, id=f"city:{c}"))
    for k in w.countries:
        cities_in = sorted(c for c, kk in w.city_country.items() if kk == k)
        text = f"{k} is a country. Its cities include {', '.join(cities_in) or 'none on record'}."
        docs.append(Document(text=text, title=k, id=f"country:{k}"))
    for co in companies:
        text = (
            f"{co} is a company in the {r.choice(INDUSTRIES)} business, headquartered in "
            f"{w.company_city[co]}. "
            f"It was founded by {w.company_founder[co]} in {r.randint(1850, 2015)}."
        )
        docs.append(Document(text=text, title=co, id=f"company:{co}"))
    w.documents = docs
    return w


def make_question(world: World, rng: np.random.Generator) -> tuple[str, str, int]:
    """(question, answer, hops) drawn with ``rng``."""
    r = random.Random(int(rng.integers(2**63 - 1)))
    person = r.choice(sorted(world.person_city))
    company = world.person_company[person]
    kind = r.randrange(4)
    if kind == 0:
        return (
            f"In which country was {person} born?",
            world.city_country[world.person_city[person]],
            2,
        )
    if kind == 1:
        return (
            f"Who founded the company that {person} works for?",
            world.company_founder[company],
            2,
        )
    if kind == 2:
        return (
            f"In which city was the founder of {company} born?",
            world.person_city[world.company_founder[company]],
            2,
        )
    return (
        f"In which country is the company that {person} works for headquartered?",
        world.city_country[world.company_city[company]],
        3,
    )


class SearchQAEnv(ToolTaskEnv):
    """Multi-hop questions answered with the ``search`` tool; no sandbox needed."""

    def __init__(
        self,
        corpus_seed: int = 0,
        people: int = 60,
        metric: Literal["em", "f1"] = "em",
        **config: Any,
    ):
        self.metric = one_of("metric", metric, ("em", "f1"))
        # each of at least 4 companies has a founder among the people
        self.world = make_world(whole("corpus_seed", corpus_seed), people=whole("people", people, low=4))
        config.setdefault("max_turns", 10)
        super().__init__(self._task, [SearchTool(self.world.documents)], None, **config)

    def _task(self, rng: np.random.Generator) -> Task:
        question, answer, hops = make_question(self.world, rng)
        metric = self.metric

        def verify(text: str) -> float:
            pred = extract_answer(text)
            em = float(normalize_answer(pred) == normalize_answer(answer))
            return em if metric == "em" else answer_f1(pred, answer)

        prompt = (
            f"{question} Use the search tool to look things up in the encyclopedia. "
            "Give your final answer on its own line as 'Answer: <name>'."
        )

        def report(text: str) -> dict[str, float]:
            pred = extract_answer(text)
            em = float(normalize_answer(pred) == normalize_answer(answer))
            return {"em": em, "f1": answer_f1(pred, answer)}

        return Task(prompt, verify=verify, info={"reference": answer, "hops": hops}, report=report)
