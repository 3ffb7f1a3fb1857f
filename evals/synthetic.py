"""Built-in synthetic sets a small model can answer, so F1 against gold means something.

* ``single``: one fact per document (a person's home city, or an object's
  access code word), among distractor documents of the same form.
* ``two-hop``: the answer needs two documents — "Mara Quill works at the
  Tessel Observatory." and "The Tessel Observatory is located in Varnholm."
  — asked as "In which city does Mara Quill work?". Distractors are documents
  of both forms about other people and organisations. This is where
  cross-document attention matters and plain KV reuse should fail.

Every document is a few hundred tokens: the fact sits among sentences of
filler prose written for this project (no real names, places or facts).
Items are seeded per index, so ``--limit 3`` is a prefix of ``--limit 30``.
"""

from __future__ import annotations

import random
from enum import Enum

from blend.evals.items import DataError, Document, Item

FIRST = (
    "Mara", "Tobin", "Elsa", "Oren", "Lysa", "Kadir", "Wren", "Ilse", "Petra", "Joran",
    "Niamh", "Casimir", "Halla", "Bastian", "Sunniva", "Emrys", "Talia", "Ruben", "Odile", "Fenn",
    "Greta", "Anselm", "Maren", "Dario", "Liesel", "Corin", "Yara", "Matthias", "Solveig", "Ivo",
)
LAST = (
    "Quill", "Harrow", "Lindqvist", "Marsh", "Okafor", "Brennick", "Castell", "Duvane", "Ferro", "Galloway",
    "Hestmark", "Ibarra", "Jessup", "Kettering", "Lorne", "Mallory", "Norquist", "Orsino", "Pell", "Rasmund",
    "Sterling", "Thorne", "Ulbrecht", "Vance", "Whitlock", "Yardley", "Zeller", "Ashdown", "Brisco", "Calloway",
)
CITIES = (
    "Varnholm", "Quenby", "Ostrava Nova", "Belmark", "Caldria", "Dunmore", "Eskerby", "Falkreach", "Grenlow",
    "Halvik", "Irondale", "Jorvale", "Kestrel Bay", "Lunmouth", "Morrowick", "Norhaven", "Orlesby", "Pellham",
    "Quarrington", "Rosvik", "Saltmere", "Tarnow Vale", "Ulmsford", "Vesterby", "Wexhollow", "Yarrowby",
    "Zennor", "Ashbridge", "Brackwater", "Coldharbour", "Dravenport", "Elmstead",
)
ORG_NAMES = (
    "Tessel", "Marrow", "Corvid", "Halden", "Brightwater", "Ostler", "Pinnacle", "Quillon", "Redfern", "Sable",
    "Thistle", "Umber", "Verity", "Wyvern", "Amberline", "Beacon", "Cobalt", "Driftwood", "Ember", "Foxglove",
)
ORG_TYPES = (
    "Observatory", "Institute", "Foundry", "Archive", "Laboratory", "Conservatory", "Shipyard", "Museum",
    "Clinic", "Press", "Brewery", "Academy",
)
OBJ_ADJ = ("red", "blue", "green", "silver", "brass", "oak", "iron", "glass", "copper", "black", "amber", "stone")
OBJ_NOUN = ("locker", "safe", "cabinet", "vault", "chest", "gate", "door", "crate", "drawer", "trunk")
# Code words rather than digit strings: a 135M model copies a word far more
# reliably than four digits tokenised one by one, so F1 measures reuse, not copying.
CODE_WORDS = (
    "juniper", "marigold", "tundra", "saffron", "quartz", "willow", "falcon", "harbour", "lantern", "nimbus",
    "orchid", "pebble", "raven", "sequoia", "thimble", "violet", "walnut", "zephyr", "basalt", "cinder",
    "dahlia", "glacier", "hazel", "indigo", "jasmine", "lotus", "mistral", "nutmeg", "obsidian", "paprika",
)

PERSON_FILLER = (
    "{s} is known among friends for a calm manner and a habit of arriving early to every appointment.",
    "In the mornings {s} usually walks for half an hour before breakfast, whatever the weather.",
    "Colleagues describe {s} as patient, careful with details and slow to lose their temper.",
    "{s} collects old postcards and keeps them in shoeboxes sorted by the colour of the sky in each picture.",
    "On weekends {s} often cooks for neighbours, favouring slow stews and bread baked the night before.",
    "A long-standing interest in music led {s} to learn the cello as an adult, with mixed results.",
    "{s} reads widely, mostly history and travel writing, and rarely finishes a novel in under a month.",
    "Friends say that {s} remembers birthdays better than anyone else they know.",
    "During the winter months {s} volunteers at a community kitchen two evenings a week.",
    "{s} once spent a summer restoring a small wooden boat, a project that took far longer than planned.",
    "When asked about hobbies, {s} usually mentions chess, gardening and long conversations over tea.",
    "{s} keeps a notebook of small observations, from the names of birds to the prices of apples.",
    "Early in life {s} wanted to become a painter, and a few of those canvases still hang in the hallway.",
    "{s} prefers trains to cars and will happily take a longer route to avoid driving.",
)
ORG_FILLER = (
    "The {s} was founded by a small group of enthusiasts who met every week in a rented back room.",
    "Visitors to the {s} often remark on its quiet corridors and the smell of old paper and polish.",
    "Over the years the {s} has grown from a handful of staff to a community of several dozen people.",
    "The building that houses the {s} has tall windows, a creaking staircase and a courtyard with a fountain.",
    "Each spring the {s} opens its doors to the public for a day of tours, talks and demonstrations.",
    "The {s} publishes a modest newsletter that reports on its work and on the lives of its members.",
    "Funding for the {s} comes partly from donations and partly from a long-standing endowment.",
    "A committee meets at the {s} once a month to decide on repairs, budgets and new projects.",
    "Former members of the {s} speak fondly of the long evenings spent arguing over small questions.",
    "The library of the {s} holds several thousand volumes, many of them donated by retired staff.",
    "In recent years the {s} has replaced its heating, its roof and most of its furniture.",
    "The {s} keeps detailed records of everything it does, some of them going back many decades.",
)
OBJECT_FILLER = (
    "{s} stands in a corner of the storeroom, beside shelves of labelled boxes and spare parts.",
    "Nobody remembers exactly who bought {s}, but it has been in use for as long as anyone can recall.",
    "The hinges of {s} were oiled last autumn, and it now opens without a sound.",
    "A small brass plate on the front of {s} bears an inventory number that no one ever reads.",
    "Staff are reminded every month to close {s} properly and to report any damage at once.",
    "{s} is checked during the yearly inventory, together with the ladders, lamps and tool chests.",
    "Several people have keys to the room, but only a few know how to open {s} itself.",
    "{s} was repainted once, and traces of the old colour still show around its edges.",
    "Inside {s} there is usually a folder of forms, a torch and a box of spare fuses.",
    "{s} is heavier than it looks, and moving it takes at least two people.",
)
GENERIC_FILLER = (
    "The weather that season was mild, with long grey afternoons and the occasional bright evening.",
    "Most people in the area rise early, and the streets are busiest just after sunrise.",
    "Local markets sell bread, cheese, dried fruit and vegetables grown in nearby fields.",
    "A narrow river runs through the district, crossed by three old bridges and one new one.",
    "Small cafes line the main square, where chess players gather on warm afternoons.",
    "The regional library keeps long opening hours and is popular with students in the winter.",
    "Buses run every twenty minutes during the day and rather less often at night.",
    "Old photographs show that the surrounding hills were once covered in orchards.",
    "The annual fair brings musicians, food stalls and crowds from the surrounding villages.",
    "In autumn the trees along the avenues turn yellow and then a deep shade of copper.",
    "Many of the older houses have thick stone walls, small windows and steep tiled roofs.",
    "Children in the neighbourhood play football in a park that used to be a railway yard.",
)


class SyntheticKind(Enum):
    """The built-in synthetic sets."""

    SINGLE = "single"
    TWO_HOP = "two-hop"


def _filler(rng: random.Random, own: tuple[str, ...], subject: str, n_own: int, n_generic: int) -> list[str]:
    sents = [s.format(s=subject) for s in rng.sample(own, n_own)]
    sents += rng.sample(GENERIC_FILLER, n_generic)
    rng.shuffle(sents)
    return sents


def _doc(rng: random.Random, title: str, fact: str, own: tuple[str, ...], subject: str) -> Document:
    """A document of ~300 tokens: filler prose with the fact inserted in the middle part."""
    sents = _filler(rng, own, subject, n_own=min(len(own), 7), n_generic=6)
    pos = rng.randint(2, len(sents) - 2)
    sents.insert(pos, fact)
    return Document(title=title, text=" ".join(sents))


def _people(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(f, l) for f in FIRST for l in LAST], n)
    return [f"{f} {l}" for f, l in pairs]


def _orgs(rng: random.Random, n: int) -> list[str]:
    names = rng.sample(ORG_NAMES, n)
    return [f"{name} {rng.choice(ORG_TYPES)}" for name in names]


def _single_item(rng: random.Random, index: int, passages: int) -> Item:
    if rng.random() < 0.5:
        people = _people(rng, passages)
        cities = rng.sample(CITIES, passages)
        docs = [
            _doc(rng, p, f"{p} lives in {c}.", PERSON_FILLER, p) for p, c in zip(people, cities)
        ]
        question, answer = f"In which city does {people[0]} live?", cities[0]
    else:
        # Keyed by a distinctive owner: with "copper crate" vs "brass locker" the
        # 135M model confuses the objects even under full prefill.
        owners = _people(rng, passages)
        objs = [f"{o}'s {a} {n}" for o, (a, n) in zip(owners, rng.sample([(a, n) for a in OBJ_ADJ for n in OBJ_NOUN], passages))]
        codes = rng.sample(CODE_WORDS, passages)
        docs = [
            _doc(rng, o, f"The access code for {o} is {c}.", OBJECT_FILLER, o)
            for o, c in zip(objs, codes)
        ]
        question, answer = f"What is the access code for {objs[0]}?", codes[0]
    order = list(range(passages))
    rng.shuffle(order)
    return Item(
        id=f"single-{index}", question=question, documents=tuple(docs[i] for i in order), answers=(answer,)
    )


def _two_hop_item(rng: random.Random, index: int, passages: int) -> Item:
    if passages < 2:
        raise DataError("synthetic:two-hop needs --passages >= 2 (the two facts live in different documents)")
    n_dis = passages - 2
    n_person = (n_dis + 1) // 2 if rng.random() < 0.5 else n_dis // 2
    n_place = n_dis - n_person
    n_orgs = 1 + n_person + n_place
    orgs = _orgs(rng, n_orgs)
    people = _people(rng, 1 + n_person)
    cities = rng.sample(CITIES, 1 + n_place)
    target_org = orgs[0]
    docs = [
        _doc(rng, people[0], f"{people[0]} works at the {target_org}.", PERSON_FILLER, people[0]),
        _doc(rng, f"The {target_org}", f"The {target_org} is located in {cities[0]}.", ORG_FILLER, target_org),
    ]
    # Distractor people work at organisations whose city is never given, and
    # distractor organisations are located in other cities.
    for i in range(n_person):
        p, o = people[1 + i], orgs[1 + i]
        docs.append(_doc(rng, p, f"{p} works at the {o}.", PERSON_FILLER, p))
    for i in range(n_place):
        o, c = orgs[1 + n_person + i], cities[1 + i]
        docs.append(_doc(rng, f"The {o}", f"The {o} is located in {c}.", ORG_FILLER, o))
    rng.shuffle(docs)
    return Item(
        id=f"two-hop-{index}",
        question=f"In which city does {people[0]} work?",
        documents=tuple(docs),
        answers=(cities[0],),
    )


def generate(kind: str, n: int, passages: int, seed: int = 0) -> list[Item]:
    """Build a synthetic set.

    Args:
        kind: ``single`` or ``two-hop``.
        n: number of items.
        passages: documents per item (the answer's documents plus distractors).
        seed: the set's seed; item i depends only on (kind, seed, i, passages).

    Returns:
        ``n`` items, each with exactly one gold answer.

    Raises:
        DataError: unknown kind or impossible sizes.
    """
    try:
        k = SyntheticKind(kind)
    except ValueError:
        names = ", ".join(f"synthetic:{m.value}" for m in SyntheticKind)
        raise DataError(f"unknown synthetic set 'synthetic:{kind}' (choose from {names})") from None
    if n < 1:
        raise DataError(f"--limit must be >= 1, got {n}")
    if passages < 1 or passages > 12:
        raise DataError(f"synthetic sets support 1..12 passages, got {passages}")
    build = _single_item if k is SyntheticKind.SINGLE else _two_hop_item
    return [build(random.Random(f"kvblend-synthetic:{k.value}:{seed}:{i}"), i, passages) for i in range(n)]
