"""Value pools for the default model's synthetic SFT and eval data: names, cities, words, topics,
e-mail addresses, dates, stock symbols, ... large enough that a model cannot pass the eval by
writing frequent training values instead of the ones in the request.

Every pool is a deterministic tuple of distinct strings (generated here from syllable and word
lists, plus real names written out below) split **by value** into a training part and a held-out
part: a value is held out iff ``sha256(pool + ":" + value) % 10 == 0`` (:func:`is_held_out_value`).
Training data draws only training values, the eval sets only held-out ones, so an eval argument,
recalled name or echoed word has never been a training target; copying it from the request is
the only way to get it right.

``draw(rng, pool, held_out)`` picks uniformly from one part. Pools (sizes in :func:`pool_sizes`):
``first_name``, ``surname``, ``city``, ``word``, ``topic``, ``email``, ``symbol``, ``song``,
``dish``, ``language``, ``timezone``, ``currency``, ``pet_name``, ``job``, ``colour``, ``animal``,
``title``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random

# Real first names (common across many languages; own list).
_FIRST = (
    "Ada",
    "Adam",
    "Aiko",
    "Alba",
    "Ali",
    "Alice",
    "Amara",
    "Amir",
    "Ana",
    "Anders",
    "Anika",
    "Anton",
    "Arjun",
    "Aya",
    "Ben",
    "Bianca",
    "Boris",
    "Bruno",
    "Carla",
    "Carlos",
    "Chen",
    "Chloe",
    "Clara",
    "Dara",
    "Daniel",
    "David",
    "Dev",
    "Diego",
    "Dina",
    "Elena",
    "Eli",
    "Elif",
    "Emil",
    "Emma",
    "Eva",
    "Farah",
    "Fatima",
    "Felix",
    "Femi",
    "Finn",
    "Gaby",
    "Goran",
    "Grace",
    "Gus",
    "Hana",
    "Hassan",
    "Hugo",
    "Ines",
    "Ingrid",
    "Ivan",
    "Jade",
    "Jamal",
    "Jana",
    "Jonas",
    "Jorge",
    "Julia",
    "Kai",
    "Karim",
    "Kenji",
    "Kofi",
    "Lars",
    "Lea",
    "Lena",
    "Leo",
    "Lina",
    "Luca",
    "Lucia",
    "Maja",
    "Malik",
    "Maria",
    "Marta",
    "Mateo",
    "Mei",
    "Mia",
    "Mila",
    "Nadia",
    "Nia",
    "Nico",
    "Nina",
    "Noah",
    "Nora",
    "Olga",
    "Omar",
    "Oscar",
    "Paula",
    "Pedro",
    "Priya",
    "Quinn",
    "Rafael",
    "Rana",
    "Rosa",
    "Ruth",
    "Sami",
    "Sara",
    "Sean",
    "Sofia",
    "Sven",
    "Tara",
    "Teo",
    "Tomas",
    "Uma",
    "Vera",
    "Victor",
    "Wei",
    "Yara",
    "Yusuf",
    "Zara",
    "Zoe",
    "Alma",
    "Basil",
    "Cyrus",
    "Delia",
    "Edwin",
    "Flora",
    "Gideon",
    "Hazel",
    "Iris",
    "Jasper",
    "Kira",
    "Luna",
    "Milo",
    "Nell",
    "Otto",
    "Pia",
    "Remy",
    "Selma",
    "Tobias",
    "Ursula",
    "Viggo",
    "Wanda",
    "Xavier",
    "Yoshi",
    "Zeno",
)
_SURNAME = (
    "Abe",
    "Adler",
    "Baker",
    "Berg",
    "Brandt",
    "Campos",
    "Costa",
    "Dahl",
    "Diaz",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Gomez",
    "Hansen",
    "Haddad",
    "Ito",
    "Jensen",
    "Kato",
    "Keller",
    "Khan",
    "Kim",
    "Klein",
    "Kowalski",
    "Lee",
    "Lopez",
    "Moreau",
    "Muller",
    "Nakamura",
    "Novak",
    "Okafor",
    "Olsen",
    "Park",
    "Patel",
    "Petrov",
    "Quist",
    "Rossi",
    "Sato",
    "Schmidt",
    "Silva",
    "Singh",
    "Suzuki",
    "Tanaka",
    "Torres",
    "Vogel",
    "Wagner",
    "Weber",
    "Wong",
    "Yilmaz",
    "Zhang",
    "Ziegler",
)
_CITY = (
    "Paris",
    "Tokyo",
    "Berlin",
    "Lima",
    "Cairo",
    "Oslo",
    "Madrid",
    "Toronto",
    "Sydney",
    "Nairobi",
    "Seoul",
    "Dublin",
    "Rome",
    "Austin",
    "Mumbai",
    "Vienna",
    "Lisbon",
    "Prague",
    "Warsaw",
    "Athens",
    "Helsinki",
    "Bergen",
    "Lyon",
    "Porto",
    "Seville",
    "Munich",
    "Hamburg",
    "Zurich",
    "Geneva",
    "Milan",
    "Naples",
    "Krakow",
    "Riga",
    "Tallinn",
    "Vilnius",
    "Budapest",
    "Sofia",
    "Istanbul",
    "Ankara",
    "Dubai",
    "Doha",
    "Tehran",
    "Karachi",
    "Delhi",
    "Chennai",
    "Dhaka",
    "Bangkok",
    "Hanoi",
    "Manila",
    "Jakarta",
    "Osaka",
    "Kyoto",
    "Busan",
    "Beijing",
    "Shanghai",
    "Taipei",
    "Perth",
    "Auckland",
    "Denver",
    "Boston",
    "Chicago",
    "Seattle",
    "Miami",
    "Dallas",
    "Phoenix",
    "Atlanta",
    "Montreal",
    "Vancouver",
    "Havana",
    "Bogota",
    "Quito",
    "Santiago",
    "Recife",
    "Accra",
    "Lagos",
    "Dakar",
    "Tunis",
    "Algiers",
    "Rabat",
    "Luanda",
    "Harare",
    "Kampala",
    "Kigali",
    "Durban",
    "Edinburgh",
    "Cardiff",
    "Leeds",
    "Bristol",
    "Glasgow",
    "Bordeaux",
    "Nantes",
    "Turin",
    "Valencia",
    "Malaga",
    "Gdansk",
    "Leipzig",
    "Dresden",
    "Cologne",
    "Antwerp",
    "Utrecht",
    "Aarhus",
    "Malmo",
    "Tampere",
    "Graz",
)
_WORD = (
    "apple",
    "river",
    "green",
    "stone",
    "cloud",
    "table",
    "music",
    "north",
    "paper",
    "light",
    "window",
    "silver",
    "garden",
    "rocket",
    "candle",
    "forest",
    "pencil",
    "summer",
    "bridge",
    "orange",
    "planet",
    "winter",
    "yellow",
    "island",
    "marble",
    "shadow",
    "violet",
    "copper",
    "meadow",
    "harbor",
    "falcon",
    "lemon",
    "tiger",
    "velvet",
    "canyon",
    "pepper",
    "spring",
    "anchor",
    "basket",
    "button",
    "castle",
    "dragon",
    "engine",
    "feather",
    "ginger",
    "hammer",
    "jacket",
    "kettle",
    "ladder",
    "magnet",
    "needle",
    "oyster",
    "pillow",
    "quartz",
    "ribbon",
    "saddle",
    "tunnel",
    "umbrella",
    "valley",
    "wallet",
    "zebra",
    "acorn",
    "badge",
    "cactus",
    "daisy",
    "eagle",
    "fabric",
    "glacier",
    "honey",
    "igloo",
    "jungle",
    "koala",
    "lantern",
    "mango",
    "nectar",
    "olive",
    "parrot",
    "quilt",
    "raven",
    "salmon",
    "tulip",
    "unicorn",
    "vessel",
    "walnut",
    "yogurt",
    "almond",
    "blossom",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "grove",
    "hollow",
    "indigo",
    "jasmine",
    "kiwi",
    "lilac",
    "mosaic",
    "nutmeg",
    "orbit",
    "pebble",
    "quiver",
    "reef",
    "sparrow",
    "thistle",
    "summit",
    "vapor",
    "willow",
    "crystal",
    "beacon",
    "cinder",
    "drizzle",
    "echo",
    "frost",
    "gravel",
    "harvest",
    "ivory",
    "jigsaw",
    "kernel",
    "lagoon",
    "mirror",
    "nomad",
    "onyx",
    "prism",
    "ripple",
    "sable",
    "timber",
    "utopia",
    "vortex",
    "wander",
    "zenith",
    "banjo",
    "comet",
    "dolphin",
    "emerald",
    "fossil",
    "garnet",
    "horizon",
    "inkwell",
    "juniper",
    "kayak",
    "lotus",
    "maple",
    "nova",
    "opal",
    "puzzle",
    "radar",
    "sonar",
    "trumpet",
    "voyage",
    "whistle",
    "yarn",
    "biscuit",
    "crater",
    "domino",
    "flute",
    "goblet",
    "hazel",
    "iceberg",
    "jewel",
    "kite",
    "lobster",
    "mammoth",
    "noodle",
    "otter",
    "pretzel",
)
_ADJ = (
    "quick",
    "quiet",
    "small",
    "ancient",
    "modern",
    "simple",
    "cheap",
    "healthy",
    "local",
    "electric",
    "wooden",
    "urban",
    "mountain",
    "coastal",
    "vegan",
    "classic",
    "tiny",
    "daily",
    "hidden",
    "famous",
)
_NOUN = (
    "bread recipes",
    "tide tables",
    "solar panels",
    "chess openings",
    "bird migration",
    "volcano types",
    "jazz standards",
    "train routes",
    "garden tools",
    "bike repairs",
    "tax rules",
    "film festivals",
    "coffee beans",
    "star maps",
    "knitting patterns",
    "cloud storage",
    "river cruises",
    "rock climbing",
    "tea blends",
    "museum tickets",
    "python generators",
    "rust lifetimes",
    "sql joins",
    "web servers",
    "sleep habits",
    "phone plans",
    "camping gear",
    "wine regions",
    "dog breeds",
    "ski resorts",
)
_DOMAINS = ("example.com", "example.org", "example.net", "mail.test", "corp.test", "uni.test")
_DISHES = (
    "pizza",
    "ramen",
    "tacos",
    "sushi",
    "curry",
    "salad",
    "burger",
    "noodles",
    "dumplings",
    "pasta",
    "falafel",
    "paella",
    "risotto",
    "pancakes",
    "soup",
    "kebab",
    "burrito",
    "omelette",
    "lasagna",
    "pho",
)
_JOBS = (
    "teacher",
    "nurse",
    "pilot",
    "baker",
    "engineer",
    "farmer",
    "lawyer",
    "painter",
    "chef",
    "doctor",
    "writer",
    "plumber",
    "dentist",
    "architect",
    "librarian",
    "musician",
    "gardener",
    "scientist",
    "tailor",
    "carpenter",
    "cashier",
    "driver",
    "editor",
    "designer",
    "pharmacist",
    "sailor",
    "student",
    "jeweller",
)
_COLOURS = (
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "pink",
    "brown",
    "black",
    "white",
    "grey",
    "teal",
    "navy",
    "gold",
    "silver",
    "maroon",
    "olive",
    "beige",
    "coral",
    "turquoise",
)
_ANIMALS = (
    "cat",
    "dog",
    "owl",
    "fox",
    "horse",
    "rabbit",
    "hamster",
    "parrot",
    "turtle",
    "goat",
    "lizard",
    "ferret",
    "pony",
    "duck",
    "goldfish",
    "snake",
    "frog",
    "hedgehog",
    "canary",
    "donkey",
)
_LANGUAGES = (
    "English",
    "French",
    "German",
    "Spanish",
    "Italian",
    "Portuguese",
    "Dutch",
    "Swedish",
    "Polish",
    "Turkish",
    "Arabic",
    "Hindi",
    "Japanese",
    "Korean",
    "Chinese",
    "Greek",
    "Finnish",
    "Czech",
    "Hungarian",
    "Romanian",
    "Danish",
    "Norwegian",
    "Thai",
    "Vietnamese",
    "Indonesian",
)
_TIMEZONES = (
    "UTC",
    "Europe/Paris",
    "Europe/Berlin",
    "Europe/London",
    "Europe/Madrid",
    "Europe/Rome",
    "Europe/Oslo",
    "Europe/Warsaw",
    "Europe/Athens",
    "Europe/Helsinki",
    "Europe/Lisbon",
    "Europe/Dublin",
    "Asia/Tokyo",
    "Asia/Seoul",
    "Asia/Shanghai",
    "Asia/Kolkata",
    "Asia/Dubai",
    "Asia/Bangkok",
    "Asia/Jakarta",
    "Asia/Manila",
    "Asia/Karachi",
    "Asia/Tehran",
    "Africa/Cairo",
    "Africa/Lagos",
    "Africa/Nairobi",
    "Africa/Accra",
    "America/Lima",
    "America/Bogota",
    "America/Chicago",
    "America/Denver",
    "America/Toronto",
    "America/Havana",
    "America/Santiago",
    "America/Phoenix",
    "Australia/Sydney",
    "Australia/Perth",
    "Pacific/Auckland",
    "Atlantic/Reykjavik",
)
_CURRENCIES = (
    "USD",
    "EUR",
    "JPY",
    "GBP",
    "CHF",
    "CAD",
    "AUD",
    "NZD",
    "SEK",
    "NOK",
    "DKK",
    "PLN",
    "CZK",
    "HUF",
    "TRY",
    "INR",
    "CNY",
    "KRW",
    "SGD",
    "HKD",
    "THB",
    "MXN",
    "BRL",
    "ZAR",
    "EGP",
    "KES",
    "NGN",
    "AED",
)
_TITLES = (
    "budget review",
    "team lunch",
    "dentist visit",
    "project kickoff",
    "yoga class",
    "book club",
    "code review",
    "parent meeting",
    "flight check",
    "band practice",
    "sprint planning",
    "job interview",
    "car service",
    "piano lesson",
    "study group",
    "birthday party",
    "quarterly report",
    "design sync",
)

# Syllables for generated names (pronounceable, Latin letters only so they tokenize like names).
_ONSET = (
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "dr",
    "gr",
    "kr",
    "st",
    "th",
    "sh",
    "ch",
    "tr",
    "fl",
    "sl",
    "",
)
_VOWEL = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y")
_CODA = ("", "", "", "n", "r", "l", "s", "m", "th", "x", "nd", "rk")
_PLACE_SUFFIX = (
    "ton",
    "burg",
    "holm",
    "ville",
    "ford",
    "stad",
    "ia",
    "mouth",
    "field",
    "port",
    "dale",
    "vik",
    "heim",
    "grad",
    "haven",
    "wick",
    "by",
    "sund",
)


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSET) + rng.choice(_VOWEL) + rng.choice(_CODA)


def _generated(seed: int, n: int, make, max_len: int = 9) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        v = make(rng)
        if v not in seen and 3 <= len(v) <= max_len:
            seen.add(v)
            out.append(v)
    return out


def _gen_first(rng: random.Random) -> str:
    return "".join(_syllable(rng) for _ in range(rng.choice((2, 2, 2, 3)))).capitalize()


def _gen_city(rng: random.Random) -> str:
    stem = "".join(_syllable(rng) for _ in range(rng.choice((1, 2))))
    return (stem + rng.choice(_PLACE_SUFFIX)).capitalize()


def _gen_symbol(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPRSTUVWXYZ") for _ in range(rng.choice((3, 4))))


def _build(name: str) -> tuple[str, ...]:
    if name == "first_name":
        vals = list(_FIRST) + _generated(11, 3000, _gen_first)
    elif name == "surname":
        vals = list(_SURNAME) + _generated(
            12,
            2000,
            lambda r: _gen_first(r) + r.choice(("", "son", "berg", "ez", "ski", "er")),
            max_len=11,
        )
    elif name == "city":
        vals = list(_CITY) + _generated(13, 4000, _gen_city, max_len=11)
    elif name == "word":
        vals = list(_WORD)
    elif name == "topic":
        vals = [f"{a} {n}" for a, n in itertools.product(_ADJ, _NOUN)] + list(_NOUN)
    elif name == "email":
        firsts = pool("first_name")
        lasts = pool("surname")
        rng = random.Random(14)
        vals = [
            f"{rng.choice(firsts).lower()}.{rng.choice(lasts).lower()}@{rng.choice(_DOMAINS)}"
            for _ in range(4000)
        ]
    elif name == "symbol":
        vals = _generated(15, 3000, _gen_symbol)
    elif name == "song":
        vals = [
            f"{a} {w}".title()
            for a, w in itertools.product(
                (
                    "blue",
                    "last",
                    "golden",
                    "silent",
                    "wild",
                    "broken",
                    "electric",
                    "midnight",
                    "paper",
                    "summer",
                ),
                _WORD,
            )
        ]
    elif name == "pet_name":
        vals = _generated(
            16, 2000, lambda r: "".join(_syllable(r) for _ in range(r.choice((1, 2)))).capitalize()
        )
    elif name == "dish":
        vals = list(_DISHES)
    elif name == "language":
        vals = list(_LANGUAGES)
    elif name == "timezone":
        vals = list(_TIMEZONES)
    elif name == "currency":
        vals = list(_CURRENCIES)
    elif name == "job":
        vals = list(_JOBS)
    elif name == "colour":
        vals = list(_COLOURS)
    elif name == "animal":
        vals = list(_ANIMALS)
    elif name == "title":
        vals = list(_TITLES) + [
            f"{w} {t}" for w in ("weekly", "final", "early", "quick") for t in _TITLES
        ]
    else:
        raise ValueError(f"pool={name!r}: unknown (known: {', '.join(POOLS)})")
    seen: set[str] = set()
    return tuple(v for v in vals if not (v in seen or seen.add(v)))


POOLS = (
    "first_name",
    "surname",
    "city",
    "word",
    "topic",
    "email",
    "symbol",
    "song",
    "pet_name",
    "dish",
    "language",
    "timezone",
    "currency",
    "job",
    "colour",
    "animal",
    "title",
)
# Pools whose values also appear in a tool schema's enum (every value must stay declarable) or
# that are too small to split: drawn from the whole pool in training and eval alike; the eval
# items are still held out as whole prompts (sft_data.is_held_out).
UNSPLIT = frozenset({"timezone", "currency", "language", "dish", "job", "colour", "animal"})


@functools.cache
def pool(name: str) -> tuple[str, ...]:
    """Every value of pool ``name`` (deterministic order).

    Raises:
        ValueError: an unknown pool name.
    """
    return _build(name)


def is_held_out_value(name: str, value: str) -> bool:
    """True for the held-out tenth of pool ``name`` (by ``sha256(name:value)``)."""
    return int(hashlib.sha256(f"{name}:{value}".encode()).hexdigest()[:8], 16) % 10 == 0


@functools.cache
def split(name: str, held_out: bool) -> tuple[str, ...]:
    """The training (``held_out`` False) or held-out part of pool ``name``; an :data:`UNSPLIT`
    pool is returned whole for both."""
    vals = pool(name)
    if name in UNSPLIT:
        return vals
    return tuple(v for v in vals if is_held_out_value(name, v) == held_out)


def draw(rng: random.Random, name: str, held_out: bool = False) -> str:
    """One value of pool ``name`` from its training or held-out part, uniformly."""
    return rng.choice(split(name, held_out))


def draw_date(rng: random.Random) -> str:
    """An ISO date ``YYYY-MM-DD`` between 2024 and 2035 (days 1-28 so every month is valid)."""
    return f"{rng.randint(2024, 2035)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def draw_time(rng: random.Random) -> str:
    """A 24-hour time ``HH:MM`` on a 5-minute grid."""
    return f"{rng.randint(0, 23):02d}:{rng.randrange(0, 60, 5):02d}"


def pool_sizes() -> dict[str, tuple[int, int]]:
    """``{pool: (training values, held-out values)}``."""
    return {n: (len(split(n, False)), len(split(n, True))) for n in POOLS}


__all__ = [
    "POOLS",
    "UNSPLIT",
    "pool",
    "split",
    "draw",
    "draw_date",
    "draw_time",
    "is_held_out_value",
    "pool_sizes",
]
