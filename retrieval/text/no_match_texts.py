"""The texts a gallery's "no good match" floor is calibrated with (``retrieval.text.no_match``): everyday things a
customer may type, drawn from many domains so that no one gallery answers more than a few of them.

Written for this package (no outside source): 24 domains (animals, birds and insects, plants, food, drink, kitchen,
furniture, household, electronics, office, tools, garden, vehicles, transport, buildings and places, nature and
weather, sport, music, toys and games, health, clothing and accessories, jewellery, body and people, materials),
about 16 a domain, each written as a shop's search box receives it: a noun or a short phrase, lower case. The
calibration leaves out the ones a gallery answers far better than the rest (a clothing shop answers "a wool scarf"),
so a domain a gallery sells costs that gallery its few phrases, not its floor.
"""

from __future__ import annotations

CALIBRATION_SOURCE = "retrieval.text.no_match_texts: 24 everyday domains, written for this package"

CALIBRATION_TEXTS: tuple[str, ...] = (
    # animals
    "a dog", "a cat", "a horse", "a cow", "a pig", "a sheep", "a goat", "a rabbit", "a hamster", "an elephant",
    "a giraffe", "a lion", "a tiger", "a bear", "a monkey", "a zebra", "a kangaroo", "a fox", "a deer", "a whale",
    # birds, fish and insects
    "a parrot", "an owl", "an eagle", "a duck", "a chicken", "a penguin", "a swan", "a goldfish", "a shark",
    "a butterfly", "a bee", "an ant", "a spider", "a ladybird", "a snail", "a frog",
    # plants
    "a rose", "a sunflower", "a tulip", "an oak tree", "a palm tree", "a cactus", "a fern", "a mushroom",
    "a potted plant", "a bonsai", "a bunch of flowers", "a pine cone", "grass", "ivy", "a lily", "moss",
    # food
    "an apple", "a banana", "an orange", "a strawberry", "a lemon", "grapes", "a pineapple", "a watermelon",
    "a carrot", "a potato", "a tomato", "broccoli", "bread", "a pizza", "a hamburger", "a sandwich", "pasta",
    "rice", "an egg", "cheese", "a chocolate bar", "a birthday cake", "a cookie", "ice cream", "soup", "sushi",
    # drink
    "a cup of coffee", "a cup of tea", "a glass of milk", "orange juice", "a bottle of wine", "beer",
    "a bottle of water", "lemonade", "a smoothie", "hot chocolate", "a cocktail", "a can of soda",
    # kitchen
    "a frying pan", "a saucepan", "a kettle", "a toaster", "a blender", "a kitchen knife", "a cutting board",
    "a wooden spoon", "a whisk", "a dinner plate", "a bowl", "a mug", "a teapot", "a fork", "a microwave oven",
    "a refrigerator", "a dishwasher", "a rolling pin",
    # furniture
    "a sofa", "an armchair", "a dining table", "a chair", "a bed", "a wardrobe", "a bookshelf", "a desk",
    "a chest of drawers", "a stool", "a bench", "a rocking chair", "a bunk bed", "a coffee table", "a cabinet",
    # household
    "a lamp", "a candle", "a mirror", "a clock", "a vase", "a pillow", "a blanket", "a rug", "curtains",
    "a towel", "a vacuum cleaner", "a broom", "a bucket", "a laundry basket", "an iron", "a light bulb",
    "a picture frame", "a doormat",
    # electronics
    "a laptop", "a smartphone", "a tablet", "a television", "a camera", "headphones", "a keyboard",
    "a computer mouse", "a monitor", "a printer", "a loudspeaker", "a game console", "a remote control",
    "a charger", "a router", "a smartwatch", "a microphone", "a hard drive",
    # office
    "a pen", "a pencil", "a notebook", "a stapler", "scissors", "a ruler", "an envelope", "a calculator",
    "a paper clip", "a folder", "sticky notes", "a whiteboard", "a calendar", "a rubber stamp", "a globe",
    # tools
    "a hammer", "a screwdriver", "a wrench", "a drill", "a saw", "pliers", "a tape measure", "a ladder",
    "a toolbox", "a nail", "a screw", "a paintbrush", "a spirit level", "a flashlight", "an axe", "a chisel",
    # garden
    "a lawn mower", "a garden hose", "a shovel", "a rake", "a wheelbarrow", "a watering can", "a flower pot",
    "a garden gnome", "a bird feeder", "a hedge trimmer", "a compost bin", "a greenhouse", "a fence", "seeds",
    # vehicles
    "a car", "a bicycle", "a motorcycle", "a bus", "a truck", "a tractor", "a scooter", "a van", "a taxi",
    "a fire engine", "an ambulance", "a police car", "a skateboard", "a pram",
    # transport
    "an airplane", "a helicopter", "a train", "a tram", "a ship", "a sailing boat", "a canoe", "a submarine",
    "a hot air balloon", "a rocket", "a traffic light", "a road sign", "a parking meter", "a bus stop",
    # buildings and places
    "a house", "a castle", "a church", "a bridge", "a lighthouse", "a skyscraper", "a barn", "a windmill",
    "a tent", "a school", "a hospital", "a supermarket", "a playground", "a swimming pool", "a railway station",
    "an airport", "a museum", "a library",
    # nature and weather
    "a mountain", "a beach", "a river", "a lake", "a forest", "a desert", "a waterfall", "a volcano",
    "the moon", "the sun", "a rainbow", "snow", "rain", "a thunderstorm", "clouds", "a sunset", "an island",
    # sport
    "a football", "a basketball", "a tennis racket", "a golf club", "a baseball bat", "a hockey stick",
    "a bowling ball", "a surfboard", "skis", "a snowboard", "ice skates", "boxing gloves", "a dumbbell",
    "a yoga mat", "a fishing rod", "a trophy",
    # music
    "a guitar", "a piano", "a violin", "a drum", "a trumpet", "a flute", "a saxophone", "a harp",
    "an accordion", "a harmonica", "a cello", "a xylophone", "sheet music", "a vinyl record", "a concert",
    # toys and games
    "a teddy bear", "a doll", "a toy car", "a kite", "a jigsaw puzzle", "a chess board", "playing cards",
    "dice", "building blocks", "a yo-yo", "a balloon", "a rubber duck", "a spinning top", "a board game",
    "a puppet", "a toy train",
    # health
    "a thermometer", "a bandage", "a toothbrush", "toothpaste", "soap", "shampoo", "a hairbrush", "a comb",
    "pills", "a first aid kit", "a stethoscope", "a wheelchair", "sunscreen", "a razor", "a syringe",
    # clothing and accessories
    "a wool scarf", "a winter coat", "a raincoat", "a baseball cap", "a sun hat", "gloves", "socks",
    "pyjamas", "a swimsuit", "a tie", "a belt", "sunglasses", "an umbrella", "a wallet", "a backpack",
    "a suitcase", "rain boots", "slippers",
    # jewellery
    "a necklace", "a ring", "earrings", "a bracelet", "a wristwatch", "a brooch", "a crown", "pearls",
    "a diamond", "a gold chain",
    # body and people
    "a baby", "a child", "an old man", "a woman", "a family", "a crowd", "a hand", "a face", "a smile",
    "a doctor", "a police officer", "a chef", "a firefighter", "a farmer", "a teacher", "a soldier",
    # materials
    "wood", "stone", "glass", "metal", "plastic", "paper", "leather", "cotton", "brick", "sand", "concrete",
    "rope",
)
