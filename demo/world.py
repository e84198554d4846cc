"""A small English-like world for the offline demo: passages from a grammar whose words carry VADER sentiment.

Every sentence has a mood (positive, negative or neutral): it opens with an adverb of that mood ("Luckily,", "Sadly,",
"Then,"), and its sentiment slots (adjectives, verbs, objects, endings) take a word of that mood, or now and then a
neutral one; a passage keeps its mood from one sentence to the next with probability `mood_persistence`. A language
model pretrained on the passages therefore continues a query with a mix of sentiments that leans towards the query's
mood, and a policy can raise VADER's score by picking positive words.

    python demo/world.py --output_dir runs/demo/world
writes pretrain.txt (language-model pretraining), queries.txt (label generation, reward and policy training) and
heldout.txt (before/after evaluation): one passage per line, disjoint slices of one seeded stream of passages.
"""

import dataclasses
import json
import os
import random
from dataclasses import dataclass

import tyro

MOODS = ("positive", "negative", "neutral")
# every sentiment word is in VADER's lexicon with the sign of its mood; the neutral words are not in it
ADJECTIVES = {
    "positive": [
        "happy",
        "kind",
        "brave",
        "wonderful",
        "beautiful",
        "lovely",
        "cheerful",
        "gentle",
        "friendly",
        "sweet",
        "glad",
        "joyful",
    ],
    "negative": [
        "sad",
        "angry",
        "cruel",
        "terrible",
        "ugly",
        "lonely",
        "bitter",
        "awful",
        "miserable",
        "nasty",
        "scared",
        "evil",
    ],
    "neutral": ["old", "young", "tall", "small", "quiet", "red", "blue", "green", "little", "wooden", "big", "short"],
}
VERBS = {
    "positive": ["loved", "praised", "hugged", "thanked", "admired", "welcomed", "enjoyed", "saved"],
    "negative": ["hated", "hurt", "blamed", "attacked", "cheated", "feared", "abandoned", "insulted"],
    "neutral": ["saw", "met", "followed", "visited", "called", "watched", "found", "passed"],
}
OBJECTS = {
    "positive": ["gift", "friend", "party", "treasure", "prize", "smile"],
    "negative": ["enemy", "thief", "disaster", "war", "grave", "liar"],
    "neutral": ["house", "river", "road", "table", "window", "village", "boat", "tree", "car", "garden"],
}
ENDINGS = {
    "positive": ["with joy", "in peace", "with hope", "with love"],
    "negative": ["in pain", "in fear", "in anger", "with tears"],
    "neutral": ["at night", "at home", "after dinner", "in town"],
}
SUBJECTS = [
    "man",
    "woman",
    "teacher",
    "dog",
    "cat",
    "girl",
    "boy",
    "farmer",
    "doctor",
    "child",
    "king",
    "sailor",
    "baker",
    "bird",
]
# every sentence opens with an adverb of its mood, so the state of a language model at a sentence's final '.' has to
# carry that mood (it predicts the next opener, whose mood mostly persists): features a reward model can read there
OPENERS = {
    "positive": ["Luckily", "Thankfully"],
    "negative": ["Sadly", "Unfortunately"],
    "neutral": ["Then", "Later", "Today", "Meanwhile", "Soon"],
}
# sentence shapes after the opener, each exactly 12 GPT-2 tokens with the opener, comma and '.' (every word below is one
# token): a 12-token response is then one whole sentence, so truncation leaves grammatical responses as they are and
# the reward model is normalized on the same kind of text it scores during PPO. {adj}/{verb}/{obj}/{end} are
# sentiment slots, {subj} a neutral noun, {a} "a" or "an"
TEMPLATES = [
    "the {adj} {subj} {verb} the {adj} {obj} {end}.",
    "the {adj} {subj} and the {subj} were very {adj}.",
    "{a} {adj} {subj} {verb} {a} {adj} {obj} {end}.",
    "the {subj} felt {adj} and {verb} the {adj} {obj}.",
    "the {adj} {subj} {verb} the {obj} and felt {adj}.",
    "the {subj} was {adj} and {verb} the {adj} {obj}.",
]
SLOTS = {"adj": ADJECTIVES, "verb": VERBS, "obj": OBJECTS, "end": ENDINGS}


@dataclass
class Args:
    output_dir: str = "runs/demo/world"
    """directory for pretrain.txt, queries.txt, heldout.txt and world.json"""
    seed: int = 0
    """seed of the passage stream: the same seed writes the same files"""
    num_pretrain: int = 20000
    """passages for language-model pretraining"""
    num_queries: int = 8000
    """passages from which label generation, reward and policy training draw their queries"""
    num_heldout: int = 2000
    """passages for the before/after evaluation, never seen in training"""
    sentences: int = 4
    """sentences per passage (a query is cut from the passage after its first sentence)"""
    mood_persistence: float = 0.5
    """probability that a sentence keeps the previous sentence's mood (otherwise a mood is drawn uniformly)"""
    mood_purity: float = 0.9
    """probability that a sentiment slot of a positive or negative sentence takes a word of that mood"""


def article(word: str) -> str:
    """'an' before a vowel, else 'a'."""
    return "an" if word[0] in "aeiou" else "a"


def sentence(rng: random.Random, mood: str, purity: float) -> str:
    """One sentence of the given mood."""
    template = rng.choice(TEMPLATES)
    words = [rng.choice(OPENERS[mood]) + ","]
    for part in template.replace(".", " .").split():
        if part.startswith("{") and part[1:-1] in SLOTS:
            slot_mood = mood if mood != "neutral" and rng.random() < purity else "neutral"
            words.append(rng.choice(SLOTS[part[1:-1]][slot_mood]))
        elif part == "{subj}":
            words.append(rng.choice(SUBJECTS))
        else:
            words.append(part)
    # articles agree with the word that follows them
    words = [article(words[i + 1]) if word == "{a}" else word for i, word in enumerate(words)]
    return " ".join(words).replace(" .", ".")


def passage(rng: random.Random, args: Args) -> str:
    """`args.sentences` sentences whose moods follow a sticky random walk."""
    mood = rng.choice(MOODS)
    sentences = []
    for _ in range(args.sentences):
        sentences.append(sentence(rng, mood, args.mood_purity))
        if rng.random() >= args.mood_persistence:
            mood = rng.choice(MOODS)
    return " ".join(sentences)


def main(args: Args) -> dict[str, str]:
    """Write the three corpus files (and world.json with the settings); returns their paths."""
    rng = random.Random(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    paths = {}
    for name, count in (("pretrain", args.num_pretrain), ("queries", args.num_queries), ("heldout", args.num_heldout)):
        paths[name] = os.path.join(args.output_dir, f"{name}.txt")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.write("\n".join(passage(rng, args) for _ in range(count)) + "\n")
    with open(os.path.join(args.output_dir, "world.json"), "w", encoding="utf-8") as f:
        json.dump({"args": dataclasses.asdict(args), "files": paths}, f, indent=2)
    return paths


if __name__ == "__main__":
    main(tyro.cli(Args))
