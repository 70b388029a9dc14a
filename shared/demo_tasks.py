"""The demo's tasks: what `nextstate demo` asks and rewards, and what the evaluator's `demo`
suite measures, defined once so the two can never disagree.

A task is a system prompt, a success criterion on an answer (`Task.ok`) and the
correction the demo's simulated user replies when an answer misses it:

  short   answer in at most 12 words (learnable by an instruct model: SmolLM2 rambles)
  vowel   the answer starts with a vowel (for tiny random test models)

`QUESTIONS` are the ones the demo asks (so the policy trains on them); `HELD_OUT_QUESTIONS`
are never asked by the demo, so the `demo` suite measures whether the criterion was
learned, not the answers to twenty questions. Both lists are append-only: the demo draws
from `QUESTIONS` with a seeded RNG and the suite takes held-out questions in a seeded
order of the whole list, so a change of either changes what a seed means (versions of a
run are compared on the same tasks only when they were scored by the same code).
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
    # 112 more, so that the suite can ask the n its gate needs (bench/gate_power.py)
    "What is the capital of Germany?", "How many legs does an insect have?",
    "What color are ripe bananas?", "Which planet is closest to the Sun?", "What is 15 plus 27?",
    "Who wrote Hamlet?", "What is the chemical symbol for iron?",
    "How many teeth does an adult human usually have?", "What is the capital of Spain?",
    "Which animal is the largest bird?", "What do cows drink?", "How many days are in a week?",
    "What is the main gas in the air we breathe?", "What is 6 times 7?",
    "Which country is famous for the Eiffel Tower?", "What do you call a baby dog?",
    "What is the capital of Russia?", "How many months have 31 days?",
    "What fruit is dried to make raisins?", "Which ocean lies between Europe and America?",
    "What is the tallest animal?", "What is 81 divided by 9?", "Who invented the telephone?",
    "What is the capital of China?", "How many hearts does an octopus have?",
    "What color do you get by mixing blue and yellow?",
    "Which instrument has six strings and a hollow body?", "What is the largest country by area?",
    "How many centimeters are in a meter?", "What do bees collect from flowers?",
    "What is the capital of India?", "What is the largest moon of Saturn?",
    "What is the boiling point of water in Fahrenheit?", "What language is spoken in Argentina?",
    "How many sides does a pentagon have?", "What is the capital of Greece?",
    "Which animal is known for its black and white stripes?", "What is 3 cubed?",
    "Who painted The Starry Night?", "What is the capital of Portugal?",
    "How many seconds are in a minute?", "What is the opposite of up?",
    "Which organ do we use to breathe?", "What is the largest ocean animal?",
    "What is the capital of Brazil?", "How many wheels does a bicycle have?",
    "What do plants need from the Sun to grow?", "What is 50 minus 18?",
    "Which metal is used in electrical wires most often?", "What is the capital of Kenya?",
    "What is a young sheep called?", "How many years are in a century?",
    "What is the national language of Japan?", "Which direction does the Sun rise in?",
    "What is the capital of Norway?", "How many planets are in the solar system?",
    "What is the main food of koalas?", "What is 7 plus 9?", "Who wrote Pride and Prejudice?",
    "What is the capital of Turkey?", "Which shape has four equal sides?",
    "What is the chemical symbol for sodium?", "What do frogs start life as?",
    "What is the capital of Sweden?", "How many grams are in a kilogram?",
    "Which bird cannot fly but swims well?",
    "What is the largest internal organ of the human body?", "What is 11 times 11?",
    "What is the capital of Peru?", "Which season is the hottest?", "What do you call frozen rain?",
    "How many zeros are in one million?", "What is the capital of Ireland?",
    "Which planet is known for its Great Red Spot?", "What is the main ingredient of bread?",
    "What is 64 divided by 8?", "Who developed the theory of relativity?",
    "What is the capital of Thailand?", "How many sides does an octagon have?",
    "What animal says moo?", "What is the currency of Japan?", "What is the capital of Argentina?",
    "Which gas makes soda fizzy?", "What is the smallest planet in the solar system?",
    "How many hours are in a week?", "What is 20 percent of 50?", "What is the capital of Poland?",
    "Which animal has a long trunk?", "What is the color of chlorophyll?",
    "What is the capital of Vietnam?", "How many players are on a basketball team on the court?",
    "Which continent is Brazil in?", "What is 13 plus 29?",
    "What is the hottest planet in the solar system?", "What is the capital of Chile?",
    "What do you call a baby horse?", "Which vitamin is found in oranges?",
    "What is the capital of the Netherlands?", "How many days are in February in a common year?",
    "What is the freezing point of water in Celsius?", "What is the capital of South Korea?",
    "Which animal is known as man's best friend?", "What is 1000 divided by 10?",
    "Who was the first president of the United States?", "What is the capital of Cuba?",
    "How many lungs does a human have?", "Which is the longest river in South America?",
    "What is the capital of Morocco?", "What do spiders spin?", "What is 25 times 4?",
    "What is the capital of Finland?", "Which planet do we live on?",
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
