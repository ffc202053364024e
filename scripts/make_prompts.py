"""Generate the project's default prompt set, `data/prompts/default.jsonl`.

Written for this project from our own templates and word lists (no public benchmark text:
those prompts are how drafters are judged). Deterministic: the same seed gives the same file.
Each line has an `id`, a `category` and either `prompt` or `messages` (multi-turn).

    python scripts/make_prompts.py [--out data/prompts/default.jsonl] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dmitri",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Nikhil",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Yusuf",
    "Zoe",
]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "seashells", "cards", "plants"]
SHOPS = ["bakery", "bookshop", "garden centre", "hardware store", "market stall", "toy shop"]

MATH = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. How many {item} does {a} have now?",
    "A {shop} sells {item} for ${p} each. {a} buys {x} of them and pays with a ${bill} note. "
    "How much change does {a} get?",
    "{a} reads {x} pages a day. The book has {n} pages. How many days does it take to finish the book?",
    "A train travels at {s} km/h for {h} hours and then at {s2} km/h for {h2} hours. "
    "What distance does it cover in total?",
    "{a} saves ${x} every week. How many weeks until {a} has saved at least ${n}?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
    "{a} and {b} share {n} {item} in the ratio {r1}:{r2}. How many does each get?",
    "The price of a jacket is ${n}. It is reduced by {pct}% in a sale. What is the sale price?",
    "A recipe needs {x} eggs for {y} people. How many eggs are needed for {z} people? Round up if needed.",
    "{a} runs {x} laps of a {m} m track. How many kilometres is that?",
    "A tank holds {n} litres and is filled at {x} litres per minute. How long does it take to fill from empty?",
    "There are {n} students and each bus seats {x}. How many buses are needed, and how many seats are left empty?",
    "{a} is {x} years old. {b} is {y} years older than twice {a}'s age. How old is {b}?",
    "A shop makes a profit of ${x} on each of the first {y} items sold and ${z} on each item after that. "
    "What is the profit on {n} items?",
    "What is the sum of all whole numbers from 1 to {n}? Explain the shortcut you use.",
    "A car uses {x} litres of fuel per 100 km. Fuel costs ${p} per litre. What does a {n} km trip cost?",
    "Solve for x: {x}x + {y} = {n}. Show each step.",
    "{a} invests ${n} at {pct}% simple interest per year. How much interest is earned after {h} years?",
]

CODING_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number iteratively",
    "counts the words in a text",
    "removes duplicates from a list while keeping order",
    "merges two sorted lists",
    "finds the largest element of an array without using built-ins",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome, ignoring case and spaces",
    "computes the factorial of n",
    "flattens a nested list",
    "groups words by their first letter",
    "parses a CSV line into fields",
    "implements binary search",
    "computes the greatest common divisor of two numbers",
    "counts how often each character appears in a string",
    "validates a simple email address",
    "transposes a matrix",
    "rotates an array by k positions",
    "implements a stack with push and pop",
    "reads a file and prints its longest line",
    "returns the second largest number in a list",
    "implements bubble sort",
    "checks whether two strings are anagrams",
    "converts a Roman numeral to an integer",
    "computes the running average of a stream of numbers",
    "finds all pairs in a list that sum to a target",
    "capitalises the first letter of every word",
    "computes the median of a list",
    "implements a simple LRU cache",
    "checks whether brackets in a string are balanced",
    "converts a decimal number to binary",
    "generates all subsets of a small set",
    "computes the dot product of two vectors",
    "finds the longest common prefix of a list of strings",
    "counts the vowels in a sentence",
    "splits a list into chunks of size n",
    "implements insertion sort",
    "returns the intersection of two lists",
    "checks whether a year is a leap year",
]
LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript"]
CODING_FORMS = [
    "Write a {lang} function that {task}.",
    "In {lang}, how would I write code that {task}? Include a short example.",
    "Write a {lang} function that {task}, and explain its time complexity.",
    "Show me a clean {lang} implementation of a function that {task}, with a comment or two.",
]
CODING_EXTRA = [
    "What is the difference between a list and a tuple in Python?",
    "Explain what a SQL JOIN does, with a small example.",
    "Write a SQL query that returns the ten most recent orders from a table called orders.",
    "How do I read a JSON file in Python?",
    "What does the `git rebase` command do, in simple terms?",
    "Explain recursion with a short example.",
    "What is a race condition and how can it be avoided?",
    "Write a shell command that counts the lines in every .txt file in a folder.",
    "What is the difference between `==` and `===` in JavaScript?",
    "Explain what Big-O notation means.",
    "How do I create a virtual environment in Python?",
    "What is a hash map and why are lookups fast?",
    "Write a regular expression that matches a five-digit postal code.",
    "Explain the difference between a process and a thread.",
    "What is dependency injection?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
]

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "gravity",
    "black holes",
    "volcanoes",
    "earthquakes",
    "the immune system",
    "vaccines",
    "DNA",
    "evolution",
    "plate tectonics",
    "the greenhouse effect",
    "renewable energy",
    "solar panels",
    "wind turbines",
    "electric cars",
    "batteries",
    "the internet",
    "encryption",
    "passwords",
    "machine learning",
    "neural networks",
    "the stock market",
    "inflation",
    "interest rates",
    "supply and demand",
    "taxes",
    "banks",
    "the Roman Empire",
    "the printing press",
    "the industrial revolution",
    "democracy",
    "the United Nations",
    "the moon landing",
    "the human heart",
    "sleep",
    "dreams",
    "memory",
    "nutrition",
    "vitamins",
    "exercise",
    "the seasons",
    "rainbows",
    "lightning",
    "tides",
    "the speed of light",
    "atoms",
    "electricity",
    "magnets",
    "sound waves",
    "music theory",
    "photography",
    "chess strategy",
    "meditation",
    "coffee",
    "bread baking",
    "composting",
    "bees",
    "coral reefs",
    "rainforests",
    "deserts",
    "glaciers",
    "recycling",
    "plastic pollution",
    "the blockchain",
    "cloud computing",
    "operating systems",
    "compilers",
    "databases",
    "time zones",
    "maps and projections",
    "GPS",
    "satellites",
    "telescopes",
    "the periodic table",
    "chemical reactions",
    "acids and bases",
    "fermentation",
    "antibiotics",
    "the brain",
    "languages and dialects",
    "writing systems",
    "the Olympic Games",
    "mountain climbing",
    "sailing",
    "airplanes",
    "how bridges stand up",
    "skyscrapers",
]
EXPLAIN_FORMS = [
    "Explain {t} in simple terms.",
    "What is {t}? Keep it short.",
    "Explain {t} to a ten-year-old.",
    "Give me three interesting facts about {t}.",
    "Why does {t} matter?",
    "Write a short paragraph about {t}.",
    "What are the most common misconceptions about {t}?",
    "Summarise how {t} works in five bullet points.",
]
COMPARE = ["Compare {a} and {b}.", "What is the difference between {a} and {b}?"]

SENTENCES = [
    "Where is the nearest train station?",
    "I would like a cup of tea, please.",
    "The weather is lovely today.",
    "Could you help me carry these bags?",
    "My brother lives in a small village by the sea.",
    "We are meeting at the library at five o'clock.",
    "This soup needs a little more salt.",
    "I have been learning to play the guitar for two years.",
    "Please close the window; it is getting cold.",
    "The museum is closed on Mondays.",
    "How much does this bicycle cost?",
    "She reads a newspaper every morning.",
    "The children are playing in the garden.",
    "I forgot my umbrella at the office.",
    "Our flight was delayed by three hours.",
    "Can you recommend a good restaurant nearby?",
    "He planted tomatoes and beans this spring.",
    "The concert starts at eight in the evening.",
    "I am looking for a birthday present for my mother.",
    "The river flooded after the storm.",
    "Thank you for your kind letter.",
    "We need to buy milk, eggs and bread.",
    "The cat is sleeping on the sofa.",
    "Turn left at the bakery and walk straight on.",
    "I will call you when I arrive.",
    "This book is more interesting than the film.",
    "The shop opens at nine.",
    "It takes twenty minutes to walk to school.",
    "My favourite season is autumn.",
    "Do you know where I can charge my phone?",
]
TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
TRANSLATE_FORMS = [
    'Translate into {lang}: "{s}"',
    'How do you say "{s}" in {lang}?',
    'Translate this sentence to {lang} and explain any tricky words: "{s}"',
]

CHAT = [
    "I have trouble falling asleep. Any tips?",
    "How can I stay motivated when studying alone?",
    "What should I pack for a three-day hiking trip?",
    "Suggest a simple dinner I can cook in twenty minutes.",
    "How do I politely decline an invitation?",
    "What are some good habits for saving money?",
    "I am nervous about a job interview tomorrow. How should I prepare?",
    "Recommend a few board games for a family evening.",
    "How can I make my small apartment feel bigger?",
    "What is a good way to start learning a new language?",
    "How do I keep houseplants alive?",
    "Give me ideas for a rainy weekend.",
    "How can I get better at public speaking?",
    "What should I consider when adopting a dog?",
    "How do I write a good thank-you note?",
    "What are some healthy snacks for work?",
    "How can I reduce my screen time?",
    "Plan a one-day visit to a new city for me.",
    "How do I deal with a difficult coworker?",
    "What are simple stretches for people who sit all day?",
    "How often should I water a cactus?",
    "What questions should I ask when renting a flat?",
    "How do I organise my week better?",
    "What is a good gift for a friend who likes cooking?",
    "Help me choose between learning the piano and the guitar.",
    "How can I make new friends in a new town?",
    "What should I do if I feel overwhelmed by work?",
    "How do I start running if I have never run before?",
    "Tell me a fun fact to share at dinner.",
    "How do I clean a cast-iron pan?",
    "What makes a good team leader?",
    "Suggest a name for a small coffee shop.",
    "How do I prepare for a long flight?",
    "What are some ways to be more creative?",
    "How can I help a friend who is feeling down?",
    "Give me a simple morning routine.",
    "What should a beginner know about investing?",
    "How do I keep a conversation going on a first meeting?",
    "Recommend a hobby I can do at home.",
    "How do I teach a child to ride a bike?",
]

WRITING_FORMS = [
    "Write a short poem about {s}.",
    "Write a four-line rhyme about {s}.",
    "Write a short story (under 150 words) about {s}.",
    "Write a haiku about {s}.",
    "Write a friendly email inviting colleagues to {e}.",
    "Write a product description for {p}.",
    "Write a motivational message for someone {m}.",
    "Write a limerick about {s}.",
]
SUBJECTS = [
    "the sea",
    "autumn leaves",
    "a lost key",
    "a lighthouse keeper",
    "a rainy city",
    "a cat who wants to fly",
    "the first snow",
    "an old bicycle",
    "a robot learning to paint",
    "a garden at night",
    "a quiet library",
    "a mountain village",
    "a friendly dragon",
    "the last train home",
    "a kite on a windy day",
    "morning coffee",
]
EVENTS = [
    "a team lunch on Friday",
    "a farewell party for a colleague",
    "a workshop on note-taking",
    "a charity run",
    "a board game night",
]
PRODUCTS = [
    "a reusable water bottle",
    "a wooden desk lamp",
    "noise-cancelling headphones",
    "a hand-made notebook",
    "a solar-powered lantern",
]
MOODS = [
    "starting a new job",
    "training for a marathon",
    "studying for exams",
    "learning to code",
    "moving to a new country",
]

PARAGRAPHS = [
    "The town council met on Tuesday to discuss the new bicycle lanes. "
    "Several residents supported the plan because it would make cycling safer, while shop owners worried that removing "
    "parking spaces would reduce the number of customers. "
    "The council agreed to run a six-month trial on one street before deciding.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. "
    "The angle of the dance shows the direction relative to the sun, and its length indicates the distance. "
    "Other bees watch the dance and then fly straight to the food.",
    "The library will extend its opening hours during the exam period. "
    "From next Monday it will open at seven in the morning and close at midnight. "
    "Students are reminded to bring their cards and to keep the quiet zones silent.",
    "Our company's sales grew by twelve percent last quarter, mainly thanks to online orders. "
    "Costs also rose because of higher delivery prices. "
    "Next quarter we plan to negotiate with new delivery partners and to launch two new products.",
    "Sourdough bread rises because of wild yeast and bacteria that live in the starter. "
    "The bacteria produce acids that give the bread its slightly sour taste. "
    "A starter must be fed with flour and water regularly to stay active.",
    "The museum's new exhibition shows tools used by farmers over the last three hundred years. "
    "Visitors can try old hand mills and see how ploughs changed as horses were replaced by tractors. "
    "The exhibition runs until the end of the summer.",
    "Regular short breaks during long work sessions can improve concentration. "
    "Many people use a method where they work for twenty-five minutes and then rest for five. "
    "After four rounds they take a longer break of about twenty minutes.",
    "A new ferry line will connect the two islands starting in May. "
    "The crossing takes forty minutes and runs six times a day. "
    "Tickets can be bought online or at the harbour, and bicycles travel for free.",
]
PARA_FORMS = [
    "Summarise this in one sentence:\n\n{p}",
    "List the key points of this text:\n\n{p}",
    "Rewrite this text in a more formal style:\n\n{p}",
    "Write three questions a reader might ask about this text:\n\n{p}",
]

MULTI_TURN = [
    [
        ("user", "Can you recommend a book for a long train journey?"),
        ("assistant", "Sure! Do you prefer fiction or non-fiction?"),
        ("user", "Fiction, something light and funny."),
    ],
    [
        ("user", "I want to start baking bread."),
        ("assistant", "Great idea. Would you like a simple yeast bread or a sourdough?"),
        ("user", "A simple yeast bread, please. What do I need?"),
    ],
    [("user", "What is 15% of 80?"), ("assistant", "15% of 80 is 12."), ("user", "And what is 80 plus that tip?")],
    [
        ("user", "Write a Python function that adds two numbers."),
        ("assistant", "def add(a, b):\n    return a + b"),
        ("user", "Now make it add any number of arguments."),
    ],
    [
        ("user", "I am planning a picnic."),
        ("assistant", "Sounds lovely! How many people are coming?"),
        ("user", "About six. What food should I bring?"),
    ],
    [
        ("user", "What is the capital of Canada?"),
        ("assistant", "The capital of Canada is Ottawa."),
        ("user", "What is it known for?"),
    ],
    [
        ("user", "Give me a word that rhymes with 'light'."),
        ("assistant", "'Bright' rhymes with 'light'."),
        ("user", "Now use both words in a short sentence."),
    ],
    [
        ("user", "How do I convert kilometres to miles?"),
        ("assistant", "Multiply the number of kilometres by about 0.621."),
        ("user", "So how many miles is 42 km?"),
    ],
    [
        ("user", "I feel tired every afternoon."),
        ("assistant", "That is common. Do you eat a big lunch?"),
        ("user", "Yes, usually pasta. Could that be the reason?"),
    ],
    [
        ("user", "Explain what a variable is in programming."),
        (
            "assistant",
            "A variable is a name that refers to a value stored in memory, so you can use and change it later.",
        ),
        ("user", "Can you show an example in JavaScript?"),
    ],
    [
        ("user", "Suggest a name for my new puppy."),
        ("assistant", "How about Biscuit, Luna or Pepper?"),
        ("user", "It is a big black dog. Any names that fit better?"),
    ],
    [
        ("user", "What is the boiling point of water?"),
        ("assistant", "At sea level, water boils at 100 degrees Celsius."),
        ("user", "Why is it lower on a mountain?"),
    ],
]


def math_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for i in range(n):
        a, b = rng.sample(NAMES, 2)
        tpl = MATH[i % len(MATH)]
        out.append(
            tpl.format(
                a=a,
                b=b,
                item=rng.choice(ITEMS),
                shop=rng.choice(SHOPS),
                x=rng.randint(2, 40),
                y=rng.randint(2, 30),
                z=rng.randint(1, 9),
                p=rng.randint(2, 15),
                bill=rng.choice([50, 100, 200]),
                n=rng.randint(60, 900),
                s=rng.randint(40, 120),
                s2=rng.randint(40, 120),
                h=rng.randint(1, 5),
                h2=rng.randint(1, 4),
                r1=rng.randint(1, 5),
                r2=rng.randint(1, 5),
                pct=rng.choice([5, 10, 15, 20, 25, 30, 40]),
                m=rng.choice([200, 400]),
            )
        )
    return out


def build(seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows: list[tuple[str, object]] = []
    rows += [("math", p) for p in math_prompts(rng, 180)]
    coding = [
        f.format(lang=lang, task=t)
        for t in CODING_TASKS
        for lang, f in [(rng.choice(LANGUAGES), rng.choice(CODING_FORMS))]
    ]
    coding += [
        CODING_FORMS[i % len(CODING_FORMS)].format(lang=LANGUAGES[i % len(LANGUAGES)], task=t)
        for i, t in enumerate(CODING_TASKS)
    ]
    rows += [("coding", p) for p in sorted(set(coding))] + [("coding", p) for p in CODING_EXTRA]
    explain = {rng.choice(EXPLAIN_FORMS).format(t=t) for t in TOPICS} | {
        EXPLAIN_FORMS[i % len(EXPLAIN_FORMS)].format(t=t) for i, t in enumerate(TOPICS)
    }
    rows += [("explanation", p) for p in sorted(explain)]
    for _ in range(40):
        a, b = rng.sample(TOPICS, 2)
        rows.append(("explanation", rng.choice(COMPARE).format(a=a, b=b)))
    trans = {
        rng.choice(TRANSLATE_FORMS).format(lang=lang, s=s) for s in SENTENCES for lang in rng.sample(TARGET_LANGS, 3)
    }
    rows += [("translation", p) for p in sorted(trans)]
    rows += [("chat", p) for p in CHAT]
    writing = {
        f.format(s=rng.choice(SUBJECTS), e=rng.choice(EVENTS), p=rng.choice(PRODUCTS), m=rng.choice(MOODS))
        for f in WRITING_FORMS
        for _ in range(8)
    }
    rows += [("writing", p) for p in sorted(writing)]
    rows += [("rewrite", f.format(p=p)) for p in PARAGRAPHS for f in PARA_FORMS]
    rows += [("multi_turn", [{"role": r, "content": c} for r, c in conv]) for conv in MULTI_TURN]
    out = []
    for i, (cat, body) in enumerate(rows):
        rec = {"id": f"dspark-{i:04d}", "category": cat}
        if isinstance(body, str):
            rec["prompt"] = body
        else:
            rec["messages"] = body
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "prompts" / "default.jsonl"))
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rows = build(args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    cats: dict[str, int] = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0) + 1
    print(f"wrote {len(rows)} prompts to {args.out}: {cats}")


if __name__ == "__main__":
    main()
