"""A small math set made locally (nothing can be downloaded): arithmetic and algebra word problems.

Every problem has an exact answer (an integer or a fraction in lowest terms, as a string), checked
by rewards.math_reward; the prompt around the question is tasks/math.py's. Each kind is a small
function that draws numbers and returns the question and its answer.
"""

from fractions import Fraction

from data.split import draw_distinct


def _fmt(x):
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


# Each kind: (rng, max_number) -> (question, exact answer, split key). The split key is the
# question, except where the operands commute: there it holds them sorted, so "What is 3 + 5?" and
# "What is 5 + 3?" land in the same split (keyed by the text, most test sums had their commuted twin
# in train).


def _add(r, m):
    a, b = r.randint(1, m), r.randint(1, m)
    return f"What is {a} + {b}?", a + b, ("add", *sorted((a, b)))


def _sub(r, m):
    a, b = sorted((r.randint(1, m), r.randint(1, m)))
    return f"What is {b} - {a}?", b - a, None


def _order_of_ops(r, m):
    a, b, c = r.randint(2, m), r.randint(2, 12), r.randint(2, 12)
    return f"What is {a} + {b} * {c}?", a + b * c, ("order_of_ops", a, *sorted((b, c)))


def _linear(r, m):
    a, b, c = r.randint(2, 12), r.randint(1, m), r.randint(1, m)
    return f"Solve for x: {a}x + {b} = {c}.", Fraction(c - b, a), None


def _fractions(r, m):
    a, b, c, d = r.randint(1, 9), r.randint(2, 9), r.randint(1, 9), r.randint(2, 9)
    question = f"What is {a}/{b} + {c}/{d}? Give the answer as a fraction in lowest terms."
    return question, Fraction(a, b) + Fraction(c, d), ("fractions", *sorted(((a, b), (c, d))))


def _cookies(r, m):
    a, b, c = r.randint(2, 9), r.randint(6, 24), r.randint(1, 12)
    question = (f"A baker makes {a} trays of {b} cookies each and sells {c} cookies. How many "
                "cookies are left?")
    return question, a * b - c, None


def _area(r, m):
    a, b = r.randint(2, m), r.randint(2, m)
    question = (f"A rectangle is {a} cm long and {b} cm wide. "
                "What is its area in square centimetres?")
    return question, a * b, ("area", *sorted((a, b)))


KINDS = {"add": _add, "sub": _sub, "order_of_ops": _order_of_ops, "linear": _linear,
         "fractions": _fractions, "cookies": _cookies, "area": _area}


def math_problems(split, n, seed=0, kinds=tuple(KINDS), max_number=99):
    """The first n distinct problems of `split` from the stream seeded by `seed`;
    kinds and max_number: difficulty."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown math kinds {sorted(unknown)}; choose from {sorted(KINDS)}")

    def make(rng):
        question, answer, operands = KINDS[rng.choice(kinds)](rng, max_number)
        # None: the question itself
        split_key = f"math:{operands}" if operands else f"math:{question}"
        return f"math:{question}", split_key, {"question": question, "answer": _fmt(answer)}

    return draw_distinct(split, n, seed, make)
