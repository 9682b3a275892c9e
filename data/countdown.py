"""Countdown problems (D1): 3-4 numbers and a target, every one solvable by construction.

A problem is made by drawing the numbers, then combining them at random, each exactly once, with
+ - * / until one value is left; if that value is a whole number in range it becomes the target and
the expression is kept as a known solution. So no problem is ever unsolvable.
"""

from fractions import Fraction

from data.split import draw_distinct

OPS = {"+": Fraction.__add__, "-": Fraction.__sub__, "*": Fraction.__mul__,
       "/": Fraction.__truediv__}


def random_solution(numbers, rng):
    """Combine all `numbers` with random ops: (exact value, expression),
    or None after a division by 0."""
    items = [(Fraction(n), str(n)) for n in numbers]
    while len(items) > 1:
        (a, a_expr), (b, b_expr) = (items.pop(rng.randrange(len(items))),
                                    items.pop(rng.randrange(len(items))))
        op = rng.choice("+-*/")
        if op == "/" and b == 0:
            return None
        items.append((OPS[op](a, b), f"({a_expr} {op} {b_expr})"))
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


def countdown_problems(split, n, seed=0, num_counts=(3, 4), max_number=99, max_target=100):
    """The first n distinct problems of `split`
    ("train" or "test") from the stream seeded by `seed`.

    Difficulty knobs: num_counts (how many numbers, drawn per problem), max_number (numbers are
    1..max_number), max_target (targets are 1..max_target). Same arguments, same problems.
    """

    def make(rng):
        numbers = [rng.randint(1, max_number) for _ in range(rng.choice(num_counts))]
        made = random_solution(numbers, rng)
        if made is None or made[0].denominator != 1 or not 1 <= made[0] <= max_target:
            return None
        target = int(made[0])
        # the order of the numbers does not make a new problem
        key = f"countdown:{sorted(numbers)}:{target}"
        return key, key, {"numbers": numbers, "target": target, "solution": made[1]}

    return draw_distinct(split, n, seed, make)
