"""Regenerates tiny_corpus.txt and words.txt (run from the repo root); the outputs are committed."""
import random

rng = random.Random(1234)
subjects = ["the cat", "the dog", "my friend", "the old man", "this movie", "the garden", "our teacher",
 "the little girl", "the city", "my brother", "the song", "the book", "the weather", "the team", "the river",
 "her mother", "the village", "the new car", "the small house", "the market", "the story", "the king",
 "the farmer", "the morning", "the forest", "my sister", "the captain", "the doctor", "the bird", "the child"]
pos = ["happy", "kind", "bright", "warm", "lovely", "good", "great", "calm", "gentle", "sweet", "brave", "wonderful", "cheerful", "friendly", "beautiful"]
neg = ["sad", "cold", "angry", "dark", "bad", "awful", "tired", "rude", "lonely", "bitter", "grim", "cruel", "gloomy", "nasty", "broken"]
verbs = ["found", "saw", "took", "made", "left", "watched", "carried", "opened", "painted", "lost"]
objs = ["box", "ball", "letter", "door", "boat", "cake", "key", "lamp", "map", "coin"]
places = ["in the park", "by the river", "near the school", "at home", "on the hill", "in the kitchen", "under the tree", "at night"]
lines = []
for _ in range(3000):
    s = rng.choice(subjects)
    k = rng.random()
    adjs = pos if rng.random() < 0.5 else neg
    if k < 0.4:
        a, b = rng.sample(adjs, 2)
        lines.append(f"{s} is {a} and {b} .")
    elif k < 0.6:
        lines.append(f"{s} felt {rng.choice(adjs)} today .")
    else:
        lines.append(f"{s} {rng.choice(verbs)} the {rng.choice(objs)} {rng.choice(places)} .")
open("posttrain/demo/data/tiny_corpus.txt", "w").write("\n".join(lines) + "\n")
open("posttrain/demo/data/words.txt", "w").write("positive: " + " ".join(pos) + "\nnegative: " + " ".join(neg) + "\nsubjects: " + "|".join(subjects) + "\n")
