"""A shop's catalogue for the text-search benchmark (benchmarks/shop_text.py): real product-like photos with the
titles, categories and prices a shop would write, made offline from installed data.

    .venv/bin/python benchmarks/shop_catalogue.py --out DIR [--seed 0] [--emoji EMOJI_DIR]

- Clothing, shoes and bags: Fashion-MNIST's Zalando photos (Debian ``dataset-fashion-mnist``), cut to the object as
  benchmarks/catalogue.py cuts them, coloured (a seeded colour of ``COLOURS`` a photo, each colour on the same number
  of a class's photos, so a query such as "red ankle boots" has answers in every seed) and set on white at varied
  shapes and sizes. Each class is a category; its title names the colour ("Red ankle boots, leather look").
- Everything else: emoji drawn as objects on white (``retrieval data prepare emoji``: Noto Color Emoji and OpenMoji),
  ``EMOJI_PRODUCTS``: fruit, vegetables, tools, cat toys, farm-animal toys, toy vehicles, instruments, sports goods,
  kitchenware, cleaning and bathroom, stationery, bakery; each emoji a product with its own title.

Per seed: which Fashion-MNIST photos are in the gallery and which in the training split, their colours, which artist's
drawing of each emoji is in the gallery (the other one is in the training split) and every photo's size and margins.
The gallery is ``manifest.csv`` (path,label,title,category,price,colour,kind: label is the category, kind the
product's type, the benchmark's ground truth); ``train.csv`` (the same columns) holds other photos of the same
products, for training a text tower without ever seeing a gallery photo. Categories not sold (``NOT_SOLD``) are in
neither: the benchmark asks for them.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

CUTOUT_THRESHOLD = 10  # a grey pixel above it is the object's (Fashion-MNIST's ground is 0), as catalogue.py cuts
FASHION_PER_CLASS = 16  # gallery photos of each class (the training split gets as many others)
COLOURS = {"black": (35, 35, 38), "grey": (140, 140, 145), "red": (200, 30, 35), "blue": (35, 70, 190),
           "green": (35, 135, 60), "yellow": (230, 195, 40), "pink": (240, 130, 175), "brown": (125, 80, 45)}
# Fashion-MNIST class -> (category, title templates, price range); {colour} is the photo's colour
FASHION = {
    "t-shirt": ("T-shirts & tops", ["{colour} cotton T-shirt", "{colour} crew-neck tee", "Women's {colour} top"],
                (8, 30)),
    "trouser": ("Trousers", ["{colour} slim-fit trousers", "{colour} chinos", "{colour} straight-leg jeans"],
                (25, 80)),
    "pullover": ("Jumpers", ["{colour} wool pullover", "{colour} knit jumper", "{colour} cable-knit sweater"],
                 (25, 90)),
    "dress": ("Dresses", ["{colour} summer dress", "{colour} midi dress", "{colour} long-sleeve dress"], (30, 120)),
    "coat": ("Coats & jackets", ["{colour} winter coat", "{colour} wool coat", "{colour} padded jacket"], (50, 220)),
    "sandal": ("Sandals", ["{colour} strappy sandals", "{colour} leather sandals", "{colour} flat sandals"],
               (20, 70)),
    "shirt": ("Shirts", ["{colour} button-down shirt", "{colour} oxford shirt", "{colour} flannel shirt"], (20, 70)),
    "sneaker": ("Trainers", ["{colour} running sneakers", "{colour} canvas trainers", "{colour} low-top sneakers"],
                (35, 140)),
    "bag": ("Bags", ["{colour} leather handbag", "{colour} tote bag", "{colour} shoulder bag"], (25, 200)),
    "ankle-boot": ("Boots", ["{colour} ankle boots, leather look", "{colour} Chelsea boots",
                             "{colour} heeled ankle boots"], (45, 160)),
}
# category -> (price range, {emoji name (retrieval data prepare emoji's manifest): product title})
EMOJI_PRODUCTS = {
    "Fruit": ((1, 6), {
        "banana": "Bananas, bunch of 5", "blueberries": "Fresh blueberries, 125 g",
        "cherries": "Sweet cherries, 500 g", "coconut": "Whole coconut", "grapes": "Red seedless grapes, 500 g",
        "green apple": "Granny Smith apples, 6 pack",
        "kiwifruit": "Kiwi fruit, pack of 4", "lemon": "Unwaxed lemons, pack of 4",
        "lemon + large green square": "Limes, pack of 5", "mango": "Ripe mango", "melon": "Honeydew melon",
        "peach": "Yellow peaches, 4 pack", "pear": "Conference pears, 1 kg", "pineapple": "Whole pineapple",
        "red apple": "Red apples, 1 kg", "strawberry": "Strawberries, 400 g", "tangerine": "Easy-peeler tangerines",
        "watermelon": "Seedless watermelon"}),
    "Vegetables": ((1, 4), {
        "aubergine": "Aubergine", "avocado": "Hass avocados, 2 pack", "bell pepper": "Green bell pepper",
        "broccoli": "Broccoli head", "carrot": "Carrots, 1 kg bag", "cucumber": "Cucumber",
        "ear of maize": "Sweetcorn cobs, 2 pack", "garlic": "Garlic bulbs, 3 pack", "hot pepper": "Red chilli peppers",
        "leafy green": "Pak choi", "onion": "Brown onions, 1 kg", "potato": "Baking potatoes, 2.5 kg",
        "tomato": "Vine tomatoes, 6 pack", "mushroom + large brown square": "Chestnut mushrooms, 250 g"}),
    "Tools": ((5, 60), {
        "axe": "Splitting axe, hickory handle", "carpentry saw": "Hand saw, 22 inch", "hammer": "Claw hammer, steel",
        "hammer and pick": "Hammer and pickaxe set", "hammer and wrench": "Hammer and spanner set",
        "ladder": "Aluminium step ladder", "magnet": "Horseshoe magnet", "nut and bolt": "Hex nuts and bolts, 100 pack",
        "pick": "Pickaxe, forged steel", "screwdriver": "Flat-head screwdriver", "toolbox": "Red metal toolbox",
        "wrench": "Adjustable wrench, 8 inch", "chains": "Steel chain, 5 m"}),
    "Cat toys & gifts": ((4, 25), {
        "cat": "Tabby cat plush toy", "cat face": "Cat face cushion", "cat + black large square": "Black cat plush toy",
        "cat face with tears of joy": "Laughing cat sticker", "cat face with wry smile": "Smirking cat mug",
        "crying cat face": "Crying kitten keyring", "grinning cat face with smiling eyes": "Happy cat badge",
        "kissing cat face with closed eyes": "Kissing cat card",
        "pouting cat face": "Grumpy cat cushion", "smiling cat face with heart-shaped eyes": "Love-struck cat magnet",
        "smiling cat face with open mouth": "Smiling kitty sticker", "weary cat face": "Shocked cat coaster"}),
    "Farm animal toys": ((3, 15), {
        "cow": "Dairy cow toy figure", "cow face": "Cow face plush", "ox": "Ox toy figure", "pig": "Pink pig toy",
        "pig face": "Pig face plush", "ram": "Ram figure with curled horns", "sheep": "Woolly sheep toy",
        "goat": "Goat toy figure", "horse": "Racing horse figure", "horse face": "Horse head plush",
        "chicken": "Hen toy figure", "rooster": "Rooster figure", "duck": "Duck toy", "turkey": "Turkey figure",
        "baby chick": "Baby chick plush"}),
    "Toy vehicles": ((6, 40), {
        "ambulance": "Toy ambulance", "articulated lorry": "Articulated lorry model", "automobile": "Red toy car",
        "bus": "Toy city bus", "delivery truck": "Delivery truck model", "fire engine": "Toy fire engine",
        "minibus": "Toy minibus", "pickup truck": "Pickup truck model", "police car": "Toy police car",
        "racing car": "Racing car model", "taxi": "Yellow taxi model", "tractor": "Toy farm tractor",
        "recreational vehicle": "Camper van model", "motor scooter": "Toy motor scooter"}),
    "Musical instruments": ((20, 600), {
        "accordion": "Piano accordion", "banjo": "Five-string banjo", "drum with drumsticks": "Snare drum with sticks",
        "guitar": "Acoustic guitar", "long drum": "Djembe hand drum", "musical keyboard": "Digital piano, 61 keys",
        "saxophone": "Alto saxophone", "trumpet": "Brass trumpet", "violin": "Violin, full size"}),
    "Sports goods": ((5, 80), {
        "american football": "American football", "baseball": "Baseball, leather",
        "basketball and hoop": "Basketball", "bowling": "Bowling ball and pins", "boxing glove": "Boxing gloves",
        "cricket bat and ball": "Cricket bat and ball",
        "field hockey stick and ball": "Field hockey stick", "ice hockey stick and puck": "Ice hockey stick and puck",
        "flying disc": "Flying disc", "rugby football": "Rugby ball", "soccer ball": "Football, size 5",
        "softball": "Softball", "table tennis paddle and ball": "Table tennis bat",
        "tennis racquet and ball": "Tennis racket and ball", "volleyball": "Volleyball"}),
    "Kitchenware": ((3, 45), {
        "fork and knife": "Cutlery set, stainless steel", "fork and knife with plate": "Dinner plate and cutlery",
        "hocho": "Chef's knife, 20 cm", "spoon": "Serving spoon", "chopsticks": "Bamboo chopsticks, 10 pairs",
        "jar": "Glass storage jar", "cooking": "Non-stick frying pan", "bowl with spoon": "Cereal bowl with spoon",
        "salt shaker": "Salt shaker", "teacup without handle": "Ceramic tea cup", "amphora": "Terracotta amphora"}),
    "Cleaning & bathroom": ((1, 40), {
        "bar of soap": "Bar of soap", "basket": "Wicker laundry basket", "broom": "Sweeping broom",
        "bucket": "Plastic bucket, 10 l", "lotion bottle": "Body lotion, 400 ml", "plunger": "Sink plunger",
        "razor": "Safety razor", "roll of paper": "Toilet roll, 9 pack", "sponge": "Kitchen sponges, 5 pack",
        "toothbrush": "Toothbrush, soft", "fire extinguisher": "Home fire extinguisher"}),
    "Stationery": ((1, 15), {
        "black nib": "Fountain pen nib", "lower left ballpoint pen": "Ballpoint pen, blue ink",
        "lower left crayon": "Wax crayons, 12 pack", "lower left fountain pen": "Fountain pen",
        "lower left paintbrush": "Artist's paintbrush", "pencil": "HB pencils, 10 pack", "memo": "Lined notepad",
        "black scissors": "Office scissors", "linked paperclips": "Paper clips, 100 pack",
        "pushpin": "Push pins, 50 pack", "round pushpin": "Map pins", "straight ruler": "Ruler, 30 cm",
        "triangular ruler": "Set square", "spiral note pad": "Spiral notebook, A5", "clipboard": "Clipboard, A4"}),
    "Bakery": ((1, 5), {
        "bagel": "Plain bagels, 4 pack", "baguette bread": "French baguette", "bread": "White sandwich loaf",
        "croissant": "Butter croissants, 4 pack", "pretzel": "Soft pretzel", "waffle": "Belgian waffles",
        "pancakes": "Pancakes, 6 pack", "doughnut": "Glazed doughnut", "cookie": "Chocolate chip cookies",
        "flatbread": "Flatbreads, 4 pack"}),
}
# Products the shop does not sell: no photo, no title of theirs is anywhere in the catalogue (checked below)
NOT_SOLD = ("dog", "puppy", "laptop", "phone", "rose", "watch", "hat", "ring", "book", "cake", "sofa", "parrot",
            "goldfish", "scarf")


def cut_out(grey: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A Fashion-MNIST photo cut to its object: the crop and its mask (None when blank)."""
    rows, cols = np.nonzero(grey > CUTOUT_THRESHOLD)
    if not len(rows):
        return None
    crop = grey[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    return crop, crop > CUTOUT_THRESHOLD


def coloured(crop: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """The grey crop as an RGB product of ``colour``: its texture kept as shading (dark folds, light highlights)."""
    shade = crop.astype(np.float32)[..., None] / 255.0
    rgb = np.asarray(colour, np.float32) * (0.55 + 0.45 * shade) + 45.0 * shade
    return np.clip(rgb, 0, 255).astype(np.uint8)


def on_white(rgb: np.ndarray, mask: np.ndarray, rng: np.random.Generator, scale: tuple[float, float]):
    """The object scaled by a seeded factor and set on a white ground with seeded margins (a cut-out product photo)."""
    from PIL import Image

    factor = rng.uniform(*scale)
    size = (max(1, round(rgb.shape[1] * factor)), max(1, round(rgb.shape[0] * factor)))
    obj = Image.fromarray(rgb).resize(size, Image.BICUBIC)
    alpha = Image.fromarray((mask * 255).astype(np.uint8)).resize(size, Image.BILINEAR)
    margins = rng.uniform(0.05, 0.25, 4)
    canvas = Image.new("RGB", (round(size[0] * (1 + margins[0] + margins[1])),
                               round(size[1] * (1 + margins[2] + margins[3]))), (255, 255, 255))
    canvas.paste(obj, (round(size[0] * margins[0]), round(size[1] * margins[2])), alpha)
    return canvas


def fashion_rows(out: Path, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """Gallery and training rows of the Fashion-MNIST products (photos written under out/images)."""
    from retrieval.data.builtin import FASHION_MNIST_CLASSES, read_fashion_mnist

    images, labels = read_fashion_mnist(None, "train")
    gallery, train = [], []
    names = list(COLOURS)
    for index, name in enumerate(FASHION_MNIST_CLASSES):
        category, titles, (low, high) = FASHION[name]
        pool = rng.permutation(np.flatnonzero(labels == index)[:500])
        for part, rows, start in (("gallery", gallery, 0), ("train", train, FASHION_PER_CLASS)):
            colours = rng.permutation(np.resize(names, FASHION_PER_CLASS))  # each colour on as many photos
            for n, (position, colour) in enumerate(zip(pool[start:start + FASHION_PER_CLASS], colours, strict=True)):
                crop, mask = cut_out(np.asarray(images[position]))
                path = Path("images") / part / name / f"{int(position):05d}.jpg"
                (out / path).parent.mkdir(parents=True, exist_ok=True)
                on_white(coloured(crop, COLOURS[colour]), mask, rng, (3, 6)).save(out / path, quality=90)
                title = titles[n % len(titles)].format(colour=colour)
                title = title[0].upper() + title[1:]
                rows.append({"path": path.as_posix(), "label": category, "title": title, "category": category,
                             "price": f"{rng.uniform(low, high):.2f}", "colour": colour, "kind": name})
    return gallery, train


def emoji_rows(out: Path, emoji: Path, rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """Gallery and training rows of the emoji products: one artist's drawing in the gallery, the other's in training."""
    from PIL import Image

    with open(emoji / "manifest.csv", newline="", encoding="utf-8") as handle:
        drawings: dict[str, list[str]] = {}
        for row in csv.DictReader(handle):
            drawings.setdefault(row["name"], []).append(row["path"])
    gallery, train = [], []
    for category, ((low, high), products) in EMOJI_PRODUCTS.items():
        for name, title in products.items():
            paths = sorted(drawings.get(name, []))
            if len(paths) != 2:
                raise SystemExit(f"emoji {name!r}: {len(paths)} drawings in {emoji}/manifest.csv (expected 2)")
            order = rng.permutation(2)
            for part, rows, source in (("gallery", gallery, paths[order[0]]), ("train", train, paths[order[1]])):
                rgb = np.asarray(Image.open(emoji / source).convert("RGB"))
                mask = (rgb < 245).any(axis=2)  # the drawing: anything not (nearly) white
                ys, xs = np.nonzero(mask)
                box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
                path = Path("images") / part / category.split()[0].lower() / f"{name.replace(' ', '_')}.jpg"
                (out / path).parent.mkdir(parents=True, exist_ok=True)
                on_white(rgb[box], mask[box], rng, (0.8, 2.2)).save(out / path, quality=90)
                rows.append({"path": path.as_posix(), "label": category, "title": title, "category": category,
                             "price": f"{rng.uniform(low, high):.2f}", "colour": "", "kind": name})
    return gallery, train


def check_not_sold(rows: list[dict]) -> None:
    """No title or category names a product the shop does not sell (its queries must have no answer)."""
    import re

    for row in rows:
        words = set(re.findall(r"[a-z]+", f"{row['title']} {row['category']}".lower()))
        clash = words & set(NOT_SOLD)
        if clash:
            raise SystemExit(f"{row['title']!r} names {sorted(clash)}, a product the catalogue says is not sold")


def build(out: Path, emoji: Path, seed: int) -> dict:
    """Write the seed's catalogue into ``out`` (manifest.csv, train.csv, images/); returns its summary."""
    rng = np.random.default_rng(seed)
    fashion_gallery, fashion_train = fashion_rows(out, rng)
    emoji_gallery, emoji_train = emoji_rows(out, emoji, rng)
    gallery, train = fashion_gallery + emoji_gallery, fashion_train + emoji_train
    check_not_sold(gallery + train)
    for name, rows in (("manifest.csv", gallery), ("train.csv", train)):
        with open(out / name, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    summary = {"seed": seed, "gallery": len(gallery), "train": len(train),
               "categories": len({row["category"] for row in gallery})}
    (out / "done.json").write_text(json.dumps(summary) + "\n")
    return summary


def catalogue(out: Path, emoji: Path, seed: int) -> Path:
    """The seed's catalogue folder, made once (a finished one is reused)."""
    if not (out / "done.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        build(out, emoji, seed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--emoji", type=Path, required=True, help="`retrieval data prepare emoji --out DIR`'s DIR")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    catalogue(args.out, args.emoji, args.seed)
    print((args.out / "done.json").read_text().strip())


if __name__ == "__main__":
    main()
