"""The demo's tasks: what `nextstate demo` asks and rewards, and what the evaluator's `demo`
suite measures, defined once so the two can never disagree.

A task is a system prompt, a success criterion on an answer (`Task.ok`) and the
correction the demo's simulated user replies when an answer misses it:

  short   answer in at most 12 words (learnable by an instruct model: SmolLM2 rambles)
  vowel   the answer starts with a vowel (for tiny random test models)

`QUESTIONS` are the ones the demo asks (so the policy trains on them); `HELD_OUT_QUESTIONS`
are never asked by the demo, so the `demo` suite measures whether the criterion was
learned, not the answers to twenty questions. Both lists are append-only: the demo draws
from `QUESTIONS` with a seeded RNG and the suite takes held-out questions by index, so a
change of either changes what a seed means.
"""

from __future__ import annotations

from dataclasses import dataclass

QUESTIONS = (
    "What is the capital of France?", "What do bees make?", "How many legs does a spider have?",
    "What color is the sky on a clear day?", "What is 7 times 8?", "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?", "What gas do plants absorb?",
    "What is the boiling point of water in Celsius?", "Which ocean is the largest?",
    "What is the freezing point of water in Fahrenheit?", "How many continents are there?",
    "What language is spoken in Brazil?", "What is the square root of 81?",
    "Which animal is known as the king of the jungle?", "What is H2O?",
    "What is the tallest mountain on Earth?", "How many days are in a leap year?",
    "What instrument has 88 keys?", "What is the chemical symbol for gold?",
)  # fmt: skip

HELD_OUT_QUESTIONS = (
    "What is the capital of Japan?", "How many sides does a hexagon have?",
    "What is the main ingredient of guacamole?", "Who painted the Mona Lisa?",
    "What is 12 times 12?", "Which planet is known as the red planet?",
    "What do caterpillars turn into?", "How many hours are in a day?",
    "What is the largest mammal on Earth?", "What metal is liquid at room temperature?",
    "In which country are the pyramids of Giza?", "What is the opposite of hot?",
    "How many strings does a standard guitar have?", "What is frozen water called?",
    "Which bird is a symbol of peace?", "What is the longest river in Africa?",
    "How many minutes are in an hour?", "What do you call a baby cat?",
    "What is the capital of Italy?", "Which organ pumps blood through the body?",
    "What is 100 divided by 4?", "What shape has three sides?",
    "Which season comes after winter?", "What is the currency of the United Kingdom?",
    "Who discovered penicillin?", "What is the smallest prime number?",
    "Which planet has the most famous rings?", "What language has the most native speakers?",
    "How many bones does an adult human have?", "What is the hardest natural substance?",
    "What do pandas mostly eat?", "Which continent is Kenya in?",
    "What is the capital of Canada?", "How many weeks are in a year?",
    "What is the primary language of Mexico?", "What do you call a group of wolves?",
    "Which gas do humans exhale?", "What is the largest desert in the world?",
    "How many players are on a soccer team on the field?", "What is the capital of Australia?",
    "Which vitamin does sunlight help the body make?", "What is 9 squared?",
    "Who was the first person to walk on the Moon?", "What is the fastest land animal?",
    "Which element has the symbol O?", "How many colors are in a rainbow?",
    "What is the capital of Egypt?", "What tool measures temperature?",
)  # fmt: skip


@dataclass(frozen=True)
class Task:
    name: str
    system: str
    correction: str

    def ok(self, text: str) -> bool:
        """Whether `text` (an answer) meets the task's criterion."""
        words = text.split()
        if self.name == "short":
            return 0 < len(words) <= 12
        if self.name == "vowel":
            stripped = text.lstrip()
            return bool(stripped) and stripped[0].lower() in "aeiou"
        raise ValueError(self.name)


TASKS = {
    "short": Task("short", "You are a helpful assistant. The user likes short answers.",
                  "That's wrong for me: far too long. Answer again in one short sentence."),
    "vowel": Task("vowel", "Answer the question.", "Wrong, try again."),
}  # fmt: skip
