"""The built-in suite of `hfllamarl bench grader`: hand-written (gold, completion, verdict) cases.

Whole completions as a model writes them, for the ways a completion states its answer that a
grader reading only the last ``\\boxed{}`` gets wrong, and their near misses (which must score 0).
Public graders' own test suites are read from JSONL files (``--suites``).
"""

from __future__ import annotations

# (gold answer, completion, the completion is right)
CASES: list[tuple[str, str, bool]] = [
    # the answer a completion commits to, boxed or not
    ("12", "We add 5 and 7. The answer is 12", True),
    ("12", "We add 5 and 7. The answer is 13", False),
    ("12", "5 + 7 = 12.\nFinal Answer: 12", True),
    ("12", "5 + 7 = 12.\nFinal Answer: The final answer is $12$. I hope it is correct.", True),
    ("12", "Final Answer: The final answer is $11$. I hope it is correct.", False),
    ("12", "**Answer:** 12", True),
    ("12", "There are 5 red and 7 blue, so 12 marbles in all.", True),
    ("12", "There are 5 red and 7 blue, so 11 marbles in all.", False),
    ("12", "Adding them gives $5+7=12$", True),
    (r"\frac{1}{2}", r"\frac{1}{2}", True),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("(1, 2)", "(1,2)", True),
    ("(1, 2)", "(2,1)", False),
    # several boxed answers read as one set or tuple
    (r"\{1, 2\}", r"The roots are \boxed{1}, \boxed{2}.", True),
    (r"\{1, 2\}", r"The roots are \boxed{1} and \boxed{2}.", True),
    ("1, 2", r"So $x=\boxed{1}$ or $x=\boxed{2}$.", True),
    (r"\{1, 2\}", r"The roots are \boxed{1}, \boxed{3}.", False),
    (r"\{1, 2\}", r"The roots are \boxed{1}.", False),
    ("2", r"First \boxed{1}. Checking again, \boxed{2}", True),
    ("2", r"\boxed{1}, \boxed{2}", False),
    # currency
    ("1000.99", "The total cost is $1,000.99.", True),
    ("1000.99", "The total cost is $1,000.98.", False),
    (r"\$18.90", "She pays $18.90 in all.", True),
    ("18.90", r"The answer is \$18.90", True),
    ("5", "Each costs $5 and the pair $10, so one is $5 each.", True),
    ("10", "Each costs $5 and the pair $10, so one is $5 each.", False),
    ("18", "The answer is 18 dollars.", True),
    # percent and unit words
    (r"28\%", "So 28 percent of them.", True),
    (r"28\%", "The answer is 28%", True),
    (r"28\%", "The answer is 29 percent", False),
    ("15", r"The area is \boxed{15 \text{ square centimeters}}", True),
    ("15", "The area is 15 square centimeters.", True),
    ("15", "The area is 16 square centimeters.", False),
    (r"90^\circ", "The angle is 90 degrees.", True),
    ("2", r"The answer is \boxed{2\pi}", False),
    # equations in another form
    ("y = 2x + 3", r"The line is $2x - y + 3 = 0$.", True),
    ("y = 2x + 3", r"The line is $2x - y - 3 = 0$.", False),
    ("x = 3", r"\boxed{3}", True),
    ("3", r"\boxed{x = 3}", True),
    # truncated or no answer
    ("12", r"So the answer is \boxed{1", False),
    ("12", "I could not solve it.", False),
]
