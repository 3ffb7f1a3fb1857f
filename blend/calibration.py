"""A small built-in calibration set for the blend quality gate.

Six short documents written for the project, each stating a few facts among
ordinary prose, and questions whose answers need one of them. Prompts put
3-4 documents in varying orders so that most documents are re-positioned.
"""

from __future__ import annotations

from dataclasses import dataclass

DOCUMENTS = (
    "The Harrow Valley railway opened in 1894 and ran for forty-one miles between the market town of "
    "Elsby and the coastal village of Pennick. Its engines were painted dark green, and the line was "
    "famous for the stone viaduct at Colt Bridge, which has eleven arches. Passenger services ended in "
    "1962, but a volunteer society now runs steam trains on the first six miles every summer weekend.",
    "Marisol Ortega is the head librarian of the Quayside Public Library. She started there in 2009 and "
    "introduced the library's night reading program, which stays open until midnight on Fridays. The "
    "library holds about ninety thousand books, a collection of old maps of the harbour, and a small "
    "room of records donated by the local folk music club.",
    "The Brightwater hydroelectric dam is 212 metres tall and holds back Lake Sorrel. Construction began "
    "in 1971 and took nine years. The dam's four turbines produce enough electricity for roughly three "
    "hundred thousand homes. Visitors can walk across the crest, and a museum at the western end explains "
    "how the valley looked before it was flooded.",
    "Tomas Lindqvist founded the Northlight Bakery in 1998 in a former fire station on Carver Street. "
    "The bakery is best known for its cardamom buns and rye sourdough, baked in a wood-fired oven that "
    "Tomas built himself. It opens at six in the morning and usually sells out of buns before ten. The "
    "bakery employs eleven people and trains two apprentices each year.",
    "The Kestrel Island lighthouse stands on the northern cliffs of the island and was first lit in 1871. "
    "Its light can be seen from thirty kilometres away and flashes white twice every ten seconds. The last "
    "keeper, Ada Finch, left in 1989 when the light became automatic. The keeper's cottage is now a small "
    "guesthouse with three rooms.",
    "Orchard Lane School has 340 pupils aged five to eleven. Its headteacher is Daniel Okafor, who joined "
    "in 2015. The school keeps bees in the far corner of its garden and sells the honey at the spring "
    "fair to raise money for the music room. Lessons start at a quarter to nine and finish at a quarter "
    "past three.",
)

QUESTIONS = (
    ("Who is the head librarian of the Quayside Public Library?", (3, 1, 4)),
    ("How tall is the Brightwater dam?", (0, 5, 2, 3)),
    ("Who was the last keeper of the Kestrel Island lighthouse?", (1, 2, 4)),
    ("What is the Northlight Bakery best known for?", (5, 0, 3, 1)),
    ("In which year did the Harrow Valley railway open?", (2, 4, 0)),
    ("Who is the headteacher of Orchard Lane School?", (4, 3, 1, 5)),
)


@dataclass(frozen=True)
class CalibrationItem:
    question: str
    documents: tuple[str, ...]


def calibration_items(n: int) -> list[CalibrationItem]:
    """The first ``n`` calibration prompts (at most six).

    Args:
        n: how many prompts; past six, all six.

    Returns:
        The items, in order, each a question and its documents' texts.
    """
    return [CalibrationItem(q, tuple(DOCUMENTS[i] for i in order)) for q, order in QUESTIONS[:n]]
