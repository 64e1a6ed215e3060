"""The fixed vocabulary behind the generated WebShop-compatible catalog (`cope.envs.webshop.catalog`).

Eight categories, five product types each. A product type fixes what its products can be:

* ``name``: the product type in words (used in instructions and as the reward's type name);
* ``nouns``: the nouns of ``name``, written out by hand. The original WebShop reward keeps the nouns of
  the product names with a spaCy part-of-speech tagger; this table is our deterministic stand-in;
* ``path``: the category path (``›``-separated, like WebShop's ``product_category``);
* ``attrs``: the attribute pool (each product gets 3 or 4 of them);
* ``options``: option groups and their values (each product offers a subset of each group's values);
* ``price``: the price range in whole dollars.

Values never repeat across the option groups of one type, and no option value equals a page button
label, so every option value is one unambiguous clickable. Stdlib only; pure data.
"""
from __future__ import annotations

COLORS = ["black", "white", "navy blue", "heather grey", "olive green", "burgundy", "beige", "pink"]
SIZES = ["x-small", "small", "medium", "large", "x-large", "xx-large"]

# name, nouns, path, attrs, options, (lo, hi) dollars
_T = tuple[str, list[str], str, list[str], dict[str, list[str]], tuple[int, int]]

TYPES: dict[str, list[_T]] = {
    "clothing": [
        ("men's t-shirt", ["men", "shirt"], "clothing › men › shirts",
         ["machine washable", "100% cotton", "short sleeve", "moisture wicking", "relaxed fit", "tagless"],
         {"size": SIZES[1:], "color": COLORS[:6]}, (9, 35)),
        ("women's yoga pants", ["women", "yoga", "pants"], "clothing › women › pants",
         ["high waist", "four-way stretch", "moisture wicking", "machine washable", "tummy control", "side pockets"],
         {"size": SIZES[:5], "color": ["black", "navy blue", "heather grey", "burgundy", "olive green"]}, (15, 45)),
        ("men's hoodie", ["men", "hoodie"], "clothing › men › sweatshirts",
         ["fleece lined", "machine washable", "full zip", "kangaroo pocket", "relaxed fit", "drawstring hood"],
         {"size": SIZES[1:], "color": COLORS[:5]}, (20, 60)),
        ("women's summer dress", ["women", "summer", "dress"], "clothing › women › dresses",
         ["floral print", "v-neck", "short sleeve", "machine washable", "flowy fit", "side pockets"],
         {"size": SIZES[:5], "color": ["pink", "white", "black", "navy blue", "olive green"]}, (18, 55)),
        ("kids' rain jacket", ["kids", "rain", "jacket"], "clothing › kids › jackets",
         ["waterproof", "hooded", "reflective trim", "lightweight", "packable", "fleece lined"],
         {"size": ["4t", "5t", "6", "8", "10", "12"], "color": ["yellow", "navy blue", "pink", "olive green"]}, (20, 50)),
    ],
    "shoes": [
        ("men's running shoes", ["men", "running", "shoes"], "shoes › men › athletic",
         ["lightweight", "breathable mesh", "non slip", "arch support", "memory foam", "cushioned sole"],
         {"size": ["7", "8", "9", "10", "11", "12"], "color": ["black", "white", "heather grey", "navy blue"]}, (35, 120)),
        ("women's ankle boots", ["women", "ankle", "boots"], "shoes › women › boots",
         ["faux leather", "side zipper", "block heel", "water resistant", "non slip", "padded insole"],
         {"size": ["6", "6.5", "7", "7.5", "8", "9"], "color": ["black", "brown", "taupe", "tan"]}, (30, 90)),
        ("women's house slippers", ["women", "house", "slippers"], "shoes › women › slippers",
         ["memory foam", "faux fur", "non slip", "machine washable", "open toe", "indoor outdoor"],
         {"size": ["5-6", "7-8", "9-10", "11-12"], "color": ["pink", "beige", "heather grey", "black"]}, (10, 35)),
        ("kids' sandals", ["kids", "sandals"], "shoes › kids › sandals",
         ["hook and loop", "quick dry", "non slip", "lightweight", "closed toe", "water friendly"],
         {"size": ["9 toddler", "11 toddler", "13 little kid", "1 big kid", "3 big kid"],
          "color": ["blue", "pink", "black", "green"]}, (12, 40)),
        ("men's hiking boots", ["men", "hiking", "boots"], "shoes › men › boots",
         ["waterproof", "ankle support", "slip resistant", "breathable", "steel shank", "padded collar"],
         {"size": ["8", "9", "10", "11", "12", "13"], "color": ["brown", "black", "tan"]}, (50, 150)),
    ],
    "electronics": [
        ("wireless earbuds", ["earbuds"], "electronics › audio › headphones",
         ["noise cancelling", "bluetooth 5.3", "water resistant", "long battery life", "charging case",
          "built-in microphone"],
         {"color": ["black", "white", "navy blue", "pink"]}, (20, 150)),
        ("portable charger", ["charger"], "electronics › power › batteries",
         ["fast charging", "usb-c", "led display", "compact", "dual output", "airline safe"],
         {"capacity": ["10000mah", "20000mah", "26800mah"], "color": ["black", "white", "blue"]}, (15, 60)),
        ("usb c cable", ["usb", "cable"], "electronics › accessories › cables",
         ["braided nylon", "fast charging", "durable", "data transfer", "tangle free"],
         {"length": ["3 ft", "6 ft", "10 ft"], "pack": ["1 pack", "2 pack", "3 pack"]}, (6, 25)),
        ("bluetooth speaker", ["bluetooth", "speaker"], "electronics › audio › speakers",
         ["waterproof", "portable", "24 hour playtime", "stereo pairing", "built-in microphone", "deep bass"],
         {"color": ["black", "blue", "red", "heather grey"]}, (25, 130)),
        ("laptop stand", ["laptop", "stand"], "electronics › accessories › stands",
         ["adjustable height", "aluminum", "foldable", "ventilated", "non slip", "portable"],
         {"color": ["silver", "space grey", "black"]}, (18, 60)),
    ],
    "home": [
        ("throw pillow covers", ["pillow", "covers"], "home › decor › pillows",
         ["machine washable", "hidden zipper", "velvet", "linen", "set of 2", "decorative"],
         {"size": ["16x16 inch", "18x18 inch", "20x20 inch"], "color": COLORS[2:]}, (9, 30)),
        ("bath towels", ["bath", "towels"], "home › bath › towels",
         ["100% cotton", "quick dry", "highly absorbent", "machine washable", "extra soft", "oeko-tex certified"],
         {"pack": ["set of 2", "set of 4", "set of 6"], "color": ["white", "beige", "heather grey", "navy blue"]}, (15, 60)),
        ("blackout curtains", ["curtains"], "home › window › curtains",
         ["thermal insulated", "noise reducing", "grommet top", "machine washable", "room darkening"],
         {"size": ["52x63 inch", "52x84 inch", "52x96 inch"], "color": ["black", "navy blue", "beige", "heather grey"]},
         (18, 55)),
        ("led desk lamp", ["desk", "lamp"], "home › lighting › lamps",
         ["dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm", "timer"],
         {"color": ["black", "white", "silver"]}, (15, 50)),
        ("bed sheet set", ["bed", "sheet", "set"], "home › bedding › sheets",
         ["deep pocket", "microfiber", "wrinkle free", "hypoallergenic", "breathable", "100% cotton"],
         {"size": ["twin", "full", "queen", "king"], "color": ["white", "beige", "heather grey", "navy blue"]}, (20, 80)),
    ],
    "beauty": [
        ("face moisturizer", ["face", "moisturizer"], "beauty › skin care › moisturizers",
         ["hyaluronic acid", "fragrance free", "for sensitive skin", "paraben free", "cruelty free", "non greasy"],
         {"size": ["1.7 oz", "3.4 oz"]}, (10, 45)),
        ("shampoo", ["shampoo"], "beauty › hair care › shampoo",
         ["sulfate free", "for dry hair", "paraben free", "color safe", "natural ingredients", "vegan"],
         {"size": ["8 fl oz", "16 fl oz", "32 fl oz"], "scent": ["unscented", "lavender", "coconut", "tea tree"]},
         (7, 30)),
        ("lipstick", ["lipstick"], "beauty › makeup › lips",
         ["long lasting", "matte finish", "cruelty free", "vegan", "moisturizing", "transfer proof"],
         {"color": ["nude", "ruby red", "pink", "berry", "coral"]}, (6, 28)),
        ("deodorant", ["deodorant"], "beauty › personal care › deodorant",
         ["aluminum free", "natural ingredients", "long lasting", "for sensitive skin", "vegan", "baking soda free"],
         {"scent": ["unscented", "cedarwood", "citrus", "lavender"], "pack": ["1 pack", "2 pack", "3 pack"]}, (6, 25)),
        ("hair dryer", ["hair", "dryer"], "beauty › hair care › tools",
         ["ionic", "lightweight", "diffuser attachment", "fast drying", "low noise", "foldable handle"],
         {"color": ["black", "pink", "white", "rose gold"]}, (20, 90)),
    ],
    "grocery": [
        ("protein bars", ["protein", "bars"], "grocery › snacks › bars",
         ["gluten free", "low sugar", "high protein", "non gmo", "keto friendly", "plant based"],
         {"flavor": ["chocolate peanut butter", "cookies and cream", "salted caramel", "blueberry"],
          "pack": ["pack of 6", "pack of 12", "pack of 24"]}, (10, 40)),
        ("ground coffee", ["coffee"], "grocery › beverages › coffee",
         ["organic", "fair trade", "dark roast", "low acid", "decaf", "kosher"],
         {"flavor": ["original", "french vanilla", "hazelnut", "mocha"], "size": ["12 oz", "24 oz", "2 lb"]}, (8, 35)),
        ("green tea", ["green", "tea"], "grocery › beverages › tea",
         ["organic", "non gmo", "individually wrapped", "sugar free", "kosher", "antioxidant rich"],
         {"flavor": ["original", "jasmine", "mint", "lemon"], "pack": ["20 count", "40 count", "100 count"]}, (5, 25)),
        ("trail mix", ["trail", "mix"], "grocery › snacks › nuts",
         ["gluten free", "no added sugar", "resealable bag", "vegan", "high fiber", "non gmo"],
         {"flavor": ["classic", "tropical", "dark chocolate", "spicy"], "size": ["8 oz", "16 oz", "26 oz"]}, (6, 25)),
        ("olive oil", ["olive", "oil"], "grocery › pantry › oils",
         ["extra virgin", "cold pressed", "organic", "non gmo", "single origin", "kosher"],
         {"size": ["16.9 fl oz", "25.3 fl oz", "33.8 fl oz"]}, (9, 40)),
    ],
    "sports": [
        ("yoga mat", ["yoga", "mat"], "sports › fitness › yoga",
         ["non slip", "extra thick", "eco friendly", "carrying strap", "lightweight", "sweat resistant"],
         {"thickness": ["1/4 inch", "1/3 inch", "1/2 inch"], "color": ["purple", "black", "blue", "pink", "green"]},
         (15, 50)),
        ("water bottle", ["water", "bottle"], "sports › outdoor › bottles",
         ["bpa free", "vacuum insulated", "leak proof", "stainless steel", "dishwasher safe", "wide mouth"],
         {"size": ["18 oz", "24 oz", "32 oz", "40 oz"], "color": ["black", "white", "blue", "green", "pink"]}, (12, 45)),
        ("resistance bands", ["resistance", "bands"], "sports › fitness › bands",
         ["latex free", "door anchor", "carrying bag", "heavy duty", "set of 5", "exercise guide"],
         {"level": ["light", "medium", "heavy", "extra heavy"]}, (10, 35)),
        ("dumbbells", ["dumbbells"], "sports › fitness › weights",
         ["neoprene coated", "non slip grip", "hex shape", "set of 2", "anti roll", "color coded"],
         {"weight": ["5 lb", "10 lb", "15 lb", "20 lb", "25 lb"]}, (18, 90)),
        ("camping tent", ["camping", "tent"], "sports › outdoor › tents",
         ["waterproof", "easy setup", "rainfly included", "ventilation windows", "lightweight", "carry bag"],
         {"capacity": ["2 person", "4 person", "6 person"], "color": ["green", "orange", "blue"]}, (45, 200)),
    ],
    "pet": [
        ("dog food", ["dog", "food"], "pet › dogs › food",
         ["grain free", "real chicken", "high protein", "no artificial preservatives", "for small breeds",
          "made in usa"],
         {"flavor": ["chicken", "salmon", "beef", "lamb"], "size": ["4 lb", "15 lb", "30 lb"]}, (12, 80)),
        ("cat litter", ["cat", "litter"], "pet › cats › litter",
         ["clumping", "unscented", "low dust", "odor control", "lightweight", "flushable"],
         {"size": ["10 lb", "20 lb", "40 lb"]}, (9, 35)),
        ("dog leash", ["dog", "leash"], "pet › dogs › leashes",
         ["reflective", "padded handle", "heavy duty", "tangle free", "traffic handle"],
         {"length": ["4 ft", "6 ft", "10 ft"], "color": ["black", "red", "blue", "pink"]}, (8, 30)),
        ("cat scratching post", ["cat", "scratching", "post"], "pet › cats › furniture",
         ["sisal rope", "stable base", "hanging toy", "easy assembly", "tall"],
         {"color": ["beige", "heather grey", "brown"]}, (15, 50)),
        ("pet bed", ["pet", "bed"], "pet › beds › beds",
         ["orthopedic", "machine washable", "non slip bottom", "removable cover", "waterproof lining", "calming"],
         {"size": SIZES[1:5], "color": ["heather grey", "brown", "beige", "navy blue"]}, (18, 70)),
    ],
}

BRANDS: dict[str, list[str]] = {
    "clothing": ["Kestrel", "Northwind", "Amberline", "Tidewell", "Loomcraft", "Fernway"],
    "shoes": ["Stridex", "Trailmark", "Cobblefield", "Softstep", "Ridgeway", "Pacewell"],
    "electronics": ["Voltaro", "Sonique", "Brightcell", "Nexwire", "Auralink", "Quantiva"],
    "home": ["Hearthly", "Hausmark", "Dwellwise", "Softnest", "Lumora", "Cozyfield"],
    "beauty": ["Purelle", "Bloomora", "Velvessa", "Glowfield", "Aromis", "Silkroot"],
    "grocery": ["Harvest Lane", "Green Acre", "Oakbarrel", "Sunmeadow", "Nutrivo", "Hillcrest"],
    "sports": ["Peakform", "Summitgear", "Flexcore", "Ironleaf", "Trekwise", "Aquaflow"],
    "pet": ["Pawsome", "Whiskerly", "Barkley", "Furhaven", "Tailtrail", "Petwell"],
}

REVIEW_TEMPLATES = [
    "Exactly as described, {attr} and worth the price.",
    "Good {name}. I wanted {attr} and it delivers.",
    "Decent quality, though not as {attr} as I hoped.",
    "Bought it for the {attr} claim. Would buy again.",
    "Arrived fast. The {name} is fine, nothing special.",
]

# Instruction lead-ins (the WebShop human instructions are lower case and start much like these).
LEADS = ["i need", "i am looking for", "i want", "find me", "i'm looking for", "i would like"]

# How an option value is asked for in an instruction, by option group; {v} is the value.
OPTION_PHRASES: dict[str, list[str]] = {
    "color": ["in {v}", "in {v} color", "with color {v}"],
    "size": ["in size {v}", "size {v}"],
    "flavor": ["with {v} flavor", "in {v} flavor"],
    "scent": ["with {v} scent", "in {v} scent"],
    "pack": ["{v}", "in {v}"],
}
DEFAULT_OPTION_PHRASES = ["with {g} {v}", "{g}: {v}"]
