"""The training text of the built-in demo model: little stories and chats about one small village.

Everything here is written for etmlx (no borrowed text). A fixed seed expands the templates below into
`data/corpus.txt`, which ships in the repository; `python -m backends.mlx.llm.builtin.corpus` rewrites
it and the tests check that the shipped file matches this generator.

The world is deliberately tiny and consistent (each villager always lives, works and keeps a pet in
the same place) so that a model of a few million parameters, trained for a couple of minutes, writes
recognisable sentences. A few accented names, curly quotes, a Japanese word and emoji make sure
multi-byte characters pass through the tokenizer and the detokenizer.

Documents are separated by one blank line. A chat document is written exactly as the built-in chat
template renders it (see `builtin_tokenizer.CHAT_TEMPLATE`), without the leading BOS.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
SEED = 20240917
STORIES = 420
CHATS = 520
# Written as text so the corpus file does not depend on the tokenizer; the tokenizer maps them to ids.
EOS_TEXT = "<|eos|>"
ROLE_TEXT = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


@dataclass(frozen=True)
class Villager:
    name: str
    he: str  # subject pronoun
    him: str  # object pronoun
    his: str  # possessive
    home: str  # completes "NAME lives ..."
    job: str
    work: str  # completes "NAME ..." describing the job
    pet: str
    pet_name: str
    likes: str


VILLAGERS = (
    Villager("Mira", "she", "her", "her", "in the blue house by the river", "baker",
             "bakes warm bread and sweet buns every morning", "a grey cat", "Pip", "plum cake"),
    Villager("Tomas", "he", "him", "his", "above the old mill", "fisherman",
             "takes his little boat out on the lake", "a brown dog", "Bruno", "the smell of rain"),
    Villager("Zoë", "she", "her", "her", "near the market square", "painter",
             "paints the hills and the boats in bright colours", "a white goose", "Lotta", "crème brûlée"),
    Villager("José", "he", "him", "his", "at the edge of the forest", "carpenter",
             "makes chairs and tables from old oak", "a black horse", "Nube", "jalapeño soup"),
    Villager("Ines", "she", "her", "her", "in the yellow house by the harbour", "teacher",
             "teaches the children to read and to count", "a green parrot", "Kiko", "long walks on the beach"),
    Villager("Kofi", "he", "him", "his", "on the windy hill", "gardener",
             "grows tomatoes, beans and tall sunflowers", "a small tortoise", "Ama", "fresh mint tea"),
    Villager("Yuki", "she", "her", "her", "next to the library", "librarian",
             "looks after the old books and the maps", "a sleepy rabbit", "Mochi", "snow and quiet evenings"),
    Villager("Leo", "he", "him", "his", "in the red house on the bridge", "musician",
             "plays the fiddle at the Café Olé", "a clever crow", "Sable", "honey and apples"),
)


@dataclass(frozen=True)
class Place:
    name: str  # "the market"
    errands: tuple[str, ...]  # complete "wanted to ..."
    sights: tuple[str, ...]  # complete "NAME saw ..."


PLACES = (
    Place("the market", ("buy fresh plums", "buy a basket of eggs", "sell some honey"),
          ("a stall full of red apples", "a man selling warm chestnuts", "bright flowers in tall buckets")),
    Place("the river", ("watch the ducks", "find smooth stones", "sit in the shade"),
          ("two ducks and their babies", "a fish jumping out of the water", "a green boat floating past")),
    Place("the old mill", ("help with the flour", "look at the big wheel", "fetch a sack of flour"),
          ("the wheel turning slowly", "white flour on every step", "a family of mice near the door")),
    Place("the harbour", ("see the fishing boats", "buy fish for supper", "wave at the sailors"),
          ("boats with blue sails", "seagulls on the wall", "nets drying in the sun")),
    Place("the library", ("find a book about boats", "return a book about stars", "read the newspaper"),
          ("rows of old books", "a map of the whole valley", "a boy reading about dragons")),
    Place("the forest", ("pick mushrooms", "collect pine cones", "listen to the birds"),
          ("a deer between the trees", "mushrooms under an oak", "a squirrel with a nut")),
    Place("the windy hill", ("fly a red kite", "look at the village", "pick wild flowers"),
          ("the whole village below", "clouds racing over the sea", "sheep eating the grass")),
    Place("the Café Olé", ("drink hot chocolate", "eat a slice of cake", "hear some music"),
          ("people laughing at small tables", "a cake with cherries on top", "a cat asleep on a chair")),
    Place("the bakery", ("buy warm bread", "order a birthday cake", "eat a sweet bun"),
          ("loaves cooling on the shelf", "a tray of cinnamon buns", "flour on the counter")),
)

# No weather in the openings: WEATHER and TROUBLES may add some, and they should not contradict it.
OPENINGS = ("One morning", "Early on Sunday", "On a quiet day", "In the evening", "Last summer",
            "One day in spring", "After lunch", "On Friday afternoon")
WEATHER = ("The sun was warm", "The wind was cold", "It was a grey and quiet day", "The sky was clear and blue",
           "Soft rain was falling")
GREETINGS = ("Good morning!", "Hello, my friend!", "What a lovely day!", "How are you today?",
             "I am happy to see you!")
TOPICS = ("the weather", "the harvest", "the new bridge", "the summer festival", "the boats in the harbour",
          "an old song", "the train to Malmö")
GIFTS = ("a red apple", "a small cake", "a yellow flower", "a shiny stone", "a jar of honey", "a warm scarf")
TROUBLES = (("the wind took {his} hat", "{friend} caught it before it reached the water"),
            ("{pet_name} ran away", "they found {pet_name} asleep under a bench"),
            ("it began to rain", "they waited under a big tree until the sun came back"),
            ("{he} lost {his} key", "{friend} found it in the grass"),
            ("the basket broke", "{friend} helped {him} carry everything home"))
ENDINGS = ("In the end, {name} walked home happy.", "That night {he} slept very well.",
           "{name} smiled all the way home.", "It was a good day for {name}.",
           "Then {name} went home and told {pet_name} everything.")
EMOJI = ("🌞", "🐈", "🍎", "🌧️", "⛵", "🎻", "🌻")


def _fill(template: str, who: Villager, friend: Villager | None = None) -> str:
    return template.format(name=who.name, he=who.he, him=who.him, his=who.his, pet_name=who.pet_name,
                           friend=friend.name if friend else "")


def _cap(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _story(rng: random.Random, who: Villager) -> str:
    place = rng.choice(PLACES)
    friend = rng.choice([v for v in VILLAGERS if v is not who])
    parts = [f"{rng.choice(OPENINGS)}, {who.name} went to {place.name}.",
             f"{_cap(who.he)} wanted to {rng.choice(place.errands)}."]
    if rng.random() < 0.5:
        parts.append(f"{rng.choice(WEATHER)}.")
    parts.append(f"There {who.he} saw {rng.choice(place.sights)}.")
    meeting = rng.randrange(3)
    if meeting == 0:
        parts.append(f"{who.name} met {friend.name}, the {friend.job}, who said, “{rng.choice(GREETINGS)}”")
    elif meeting == 1:
        parts.append(f"{friend.name} came by with {friend.pet_name}, {friend.pet}.")
        parts.append(f"They talked about {rng.choice(TOPICS)}.")
    else:
        parts.append(f"{friend.name} gave {who.name} {rng.choice(GIFTS)}.")
        if who.name == "Yuki":
            parts.append("Yuki said “ありがとう”, which means thank you.")
        else:
            parts.append(f"{who.name} said thank you.")
    if rng.random() < 0.4:
        trouble, fix = rng.choice(TROUBLES)
        parts.append(f"Suddenly {_fill(trouble, who, friend)}, but {_fill(fix, who, friend)}.")
    parts.append(_fill(rng.choice(ENDINGS), who))
    if rng.random() < 0.25:
        parts.append(rng.choice(EMOJI))
    return " ".join(parts)


def _about(rng: random.Random, who: Villager) -> tuple[str, str]:
    """One question about a villager and its (always the same) answer."""
    kind = rng.randrange(6)
    if kind == 0:
        return f"Where does {who.name} live?", f"{who.name} lives {who.home}."
    if kind == 1:
        return (f"What does {who.name} do?",
                f"{who.name} is a {who.job}. {_cap(who.he)} {who.work}.")
    if kind == 2:
        return (f"Does {who.name} have a pet?",
                f"Yes. {who.name} has {who.pet} called {who.pet_name}.")
    if kind == 3:
        return f"What does {who.name} like?", f"{who.name} likes {who.likes}."
    if kind == 4:
        return (f"Who is {who.name}?",
                f"{who.name} is the {who.job} of the village and lives {who.home}.")
    return f"Tell me a story about {who.name}.", _story(rng, who)


def _chat(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.08:
        turns = [("user", rng.choice(("Hello!", "Hi!", "Good morning!"))),
                 ("assistant", "Hello! Ask me about the people of the village.")]
    elif roll < 0.12:
        turns = [("user", "Who lives in the village?"),
                 ("assistant", "Mira, Tomas, Zoë, José, Ines, Kofi, Yuki and Leo live in the village.")]
    else:
        turns = list(_exchange(rng, rng.choice(VILLAGERS)))
        if rng.random() < 0.3:
            turns += _exchange(rng, rng.choice(VILLAGERS))
        if rng.random() < 0.15:
            turns += [("user", "Thank you."), ("assistant", "You are welcome!")]
    if rng.random() < 0.15:
        turns.insert(0, ("system", "You know everyone in the village."))
    return render_chat(turns)


def _exchange(rng: random.Random, who: Villager) -> list[tuple[str, str]]:
    question, answer = _about(rng, who)
    return [("user", question), ("assistant", answer)]


def render_chat(turns: list[tuple[str, str]]) -> str:
    """Turns as the built-in chat template lays them out (without the BOS that starts a rendered chat)."""
    return "\n".join(f"{ROLE_TEXT[role]}\n{content}{EOS_TEXT}" for role, content in turns)


def generate_corpus(seed: int = SEED) -> str:
    rng = random.Random(seed)
    docs = [_story(rng, rng.choice(VILLAGERS)) for _ in range(STORIES)]
    docs += [_chat(rng) for _ in range(CHATS)]
    rng.shuffle(docs)
    return "\n\n".join(docs) + "\n"


def split_documents(text: str) -> list[str]:
    return [doc for doc in text.split("\n\n") if doc.strip()]


def load_documents(path: Path = CORPUS_PATH) -> list[str]:
    return split_documents(Path(path).read_text(encoding="utf-8"))


def main() -> int:
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_PATH.write_text(generate_corpus(), encoding="utf-8")
    print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
