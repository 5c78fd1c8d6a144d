"""Word lists the WebShop-style catalog is generated from.

Plain data: categories, product types with their attribute pools and option
groups, option values and how an instruction phrases them. Editing these
lists changes the generated catalog; nothing here runs code.
"""

from __future__ import annotations

__all__ = ["BRAND_PARTS", "CATEGORIES", "OPTION_GROUPS", "OPTION_PHRASES", "STYLE_WORDS"]

# option group -> every value a product of that group may offer.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "size": ("x-small", "small", "medium", "large", "x-large", "xx-large"),
    "shoe size": ("6", "7", "7.5", "8", "8.5", "9", "9.5", "10", "11", "12"),
    "color": (
        "black",
        "white",
        "navy blue",
        "gray",
        "red",
        "green",
        "beige",
        "pink",
        "brown",
        "purple",
    ),
    "count": ("6 count", "12 count", "24 count", "36 count", "48 count"),
    "pack": ("pack of 1", "pack of 2", "pack of 3", "pack of 4", "pack of 6"),
    "flavor": (
        "sea salt",
        "chocolate",
        "vanilla",
        "original",
        "peanut butter",
        "strawberry",
        "cinnamon",
        "mixed berry",
    ),
    "scent": ("lavender", "unscented", "coconut", "citrus", "eucalyptus", "rose"),
    "volume": ("2 fl oz", "4 fl oz", "8 fl oz", "16 fl oz", "32 fl oz"),
    "weight": ("8 ounce", "12 ounce", "1 pound", "2 pound", "5 pound"),
    "length": ("3 ft", "6 ft", "10 ft", "15 ft"),
    "bed size": ("twin", "full", "queen", "king", "california king"),
    "rug size": ("2x3 ft", "3x5 ft", "5x7 ft", "8x10 ft"),
    "pillow size": ("16x16 inch", "18x18 inch", "20x20 inch", "24x24 inch"),
    "phone model": ("iphone 14", "iphone 15", "galaxy s23", "galaxy s24", "pixel 8"),
}

# How an instruction names a chosen option value; "{}" is the value.
OPTION_PHRASES: dict[str, str] = {
    "size": "in size {}",
    "shoe size": "in size {}",
    "color": "in {} color",
    "count": "of {}",
    "pack": "in a {}",
    "flavor": "with {} flavor",
    "scent": "with {} scent",
    "volume": "of {}",
    "weight": "of {}",
    "length": "of {} length",
    "bed size": "in {} size",
    "rug size": "of size {}",
    "pillow size": "of size {}",
    "phone model": "for {}",
}

_FOOD = (
    "gluten free",
    "non gmo",
    "keto friendly",
    "sugar free",
    "low carb",
    "high protein",
    "usda organic",
    "kosher certified",
    "dairy free",
    "individually wrapped",
    "low sodium",
    "plant based",
)
_BEAUTY = (
    "paraben free",
    "sulfate free",
    "cruelty free",
    "long lasting",
    "natural ingredients",
    "dry skin",
    "sensitive skin",
    "travel size",
    "fragrance free",
    "hyaluronic acid",
    "oil free",
    "easy to use",
)
_FASHION = (
    "machine wash",
    "moisture wicking",
    "slim fit",
    "relaxed fit",
    "button closure",
    "elastic waist",
    "long sleeve",
    "short sleeve",
    "quick drying",
    "polyester spandex",
    "cotton blend",
    "hand wash",
)
_SHOES = (
    "rubber sole",
    "memory foam",
    "non slip",
    "lace up",
    "arch support",
    "breathable mesh",
    "lightweight",
    "water resistant",
)
_HOME = (
    "easy clean",
    "machine washable",
    "non slip",
    "eco friendly",
    "dishwasher safe",
    "living room",
    "bedroom",
    "space saving",
    "heavy duty",
    "high density",
    "microwave safe",
    "easy assemble",
)
_TECH = (
    "fast charging",
    "high speed",
    "noise cancelling",
    "water resistant",
    "easy install",
    "long battery life",
    "wireless charging",
    "shockproof",
    "hands free",
    "plug and play",
    "high definition",
    "usb c",
)
_HEALTH = (
    "sugar free",
    "non gmo",
    "vegan",
    "third party tested",
    "easy to swallow",
    "gluten free",
    "alcohol free",
    "bpa free",
    "dentist recommended",
    "soy free",
)

# category -> product type -> (attribute pool, option groups, (min price, max price)).
CATEGORIES: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[float, float]]]] = {
    "grocery & gourmet food": {
        "snack pack": (_FOOD, ("flavor", "count"), (8.0, 40.0)),
        "coffee beans": (_FOOD, ("flavor", "weight"), (9.0, 45.0)),
        "herbal tea": (_FOOD, ("flavor", "count"), (5.0, 30.0)),
        "protein bar": (_FOOD, ("flavor", "count"), (12.0, 50.0)),
        "granola": (_FOOD, ("flavor", "weight"), (6.0, 28.0)),
        "dark chocolate": (_FOOD, ("flavor", "pack"), (5.0, 35.0)),
        "olive oil": (_FOOD, ("volume", "pack"), (8.0, 60.0)),
        "beef jerky": (_FOOD, ("flavor", "weight"), (7.0, 40.0)),
    },
    "beauty & personal care": {
        "shampoo": (_BEAUTY, ("scent", "volume"), (6.0, 40.0)),
        "conditioner": (_BEAUTY, ("scent", "volume"), (6.0, 40.0)),
        "face moisturizer": (_BEAUTY, ("scent", "volume"), (9.0, 70.0)),
        "lip balm": (_BEAUTY, ("flavor", "pack"), (3.0, 20.0)),
        "body wash": (_BEAUTY, ("scent", "volume"), (5.0, 30.0)),
        "sunscreen lotion": (_BEAUTY, ("scent", "volume"), (7.0, 35.0)),
        "makeup brush set": (_BEAUTY, ("color", "pack"), (8.0, 45.0)),
    },
    "clothing, shoes & jewelry": {
        "t-shirt": (_FASHION, ("size", "color"), (8.0, 35.0)),
        "hoodie": (_FASHION, ("size", "color"), (18.0, 65.0)),
        "jogger pants": (_FASHION, ("size", "color"), (15.0, 55.0)),
        "summer dress": (_FASHION, ("size", "color"), (16.0, 70.0)),
        "rain jacket": (_FASHION, ("size", "color"), (25.0, 110.0)),
        "ankle socks": (_FASHION, ("size", "pack"), (6.0, 25.0)),
        "running shoes": (_SHOES, ("shoe size", "color"), (30.0, 130.0)),
        "slip on sneakers": (_SHOES, ("shoe size", "color"), (20.0, 90.0)),
    },
    "home & kitchen": {
        "throw pillow cover": (_HOME, ("pillow size", "color"), (7.0, 35.0)),
        "shower curtain": (_HOME, ("color", "size"), (10.0, 40.0)),
        "coffee mug": (_HOME, ("color", "pack"), (8.0, 30.0)),
        "bath towel set": (_HOME, ("color", "pack"), (15.0, 60.0)),
        "table lamp": (_HOME, ("color", "pack"), (18.0, 90.0)),
        "storage basket": (_HOME, ("color", "size"), (10.0, 45.0)),
        "area rug": (_HOME, ("rug size", "color"), (25.0, 200.0)),
        "bed sheet set": (_HOME, ("bed size", "color"), (20.0, 95.0)),
    },
    "electronics": {
        "phone case": (_TECH, ("phone model", "color"), (6.0, 30.0)),
        "usb cable": (_TECH, ("length", "pack"), (5.0, 25.0)),
        "wireless earbuds": (_TECH, ("color", "pack"), (15.0, 150.0)),
        "power bank": (_TECH, ("color", "pack"), (12.0, 70.0)),
        "hdmi cable": (_TECH, ("length", "pack"), (6.0, 30.0)),
        "bluetooth speaker": (_TECH, ("color", "pack"), (18.0, 120.0)),
        "screen protector": (_TECH, ("phone model", "pack"), (5.0, 20.0)),
        "wall charger": (_TECH, ("color", "pack"), (8.0, 40.0)),
    },
    "health & household": {
        "vitamin d supplement": (_HEALTH, ("count", "pack"), (7.0, 35.0)),
        "fish oil capsules": (_HEALTH, ("count", "pack"), (9.0, 45.0)),
        "multivitamin gummies": (_HEALTH, ("flavor", "count"), (8.0, 40.0)),
        "protein powder": (_HEALTH, ("flavor", "weight"), (18.0, 75.0)),
        "electric toothbrush": (_HEALTH, ("color", "pack"), (20.0, 120.0)),
        "hand sanitizer": (_HEALTH, ("scent", "volume"), (4.0, 25.0)),
        "dish soap": (_HEALTH, ("scent", "volume"), (3.0, 20.0)),
    },
}

# Syllables for made-up brand names ("Norvela", "Kalitra", ...).
BRAND_PARTS: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("nor", "kal", "vel", "zan", "bri", "lum", "ora", "tes", "mar", "fen", "qui", "dax", "sol"),
    ("vela", "itra", "ora", "ex", "ona", "ia", "ix", "ento", "ar", "usa", "eon", "ly"),
)

# Descriptive words mixed into titles so products of one type differ in text.
STYLE_WORDS: tuple[str, ...] = (
    "premium",
    "classic",
    "everyday",
    "deluxe",
    "essential",
    "ultra",
    "pro",
    "signature",
    "family size",
    "original",
    "value",
    "compact",
    "advanced",
    "natural",
    "modern",
)
