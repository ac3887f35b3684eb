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
    # an answer stated after the last box
    ("10455", r"So \boxed{255} is the interest, and she has $10,200 + $255 = $10,455. "
              r"Final Answer: The final answer is $10,455$.", True),
    ("10455", r"So \boxed{255} is the interest, and she has $10,200 + $255 = $10,455. "
              r"Final Answer: The final answer is $10,454$.", False),
    ("12", r"Hence \boxed{12}. The answer is correct, as checked.", True),
    # the last math span or the last number, whichever comes later
    ("12", r"Each divisor $n$ gives $d = \frac{90}{n}$. Therefore, there are 12 such sequences.", True),
    ("12", r"Each divisor $n$ gives $d = \frac{90}{n}$. Therefore, there are 13 such sequences.", False),
    # numbers in prose: a decimal comma, a unit glued on
    ("2.74", "Le prix : 2,74 € en tout.", True),
    ("1000.99", "So it is 1,000.99m² in all.", True),
    ("1000.99", "So it is 1,000.98m² in all.", False),
    # exact values compare exactly; a decimal may round a value that has no finite decimal form
    (r"\frac{1}{3}", r"The probability is \boxed{0.3333}.", True),
    (r"\frac{1}{3}", r"The probability is \boxed{0.33}.", False),
    (r"-\frac{2010012}{2010013}", r"So $p = \boxed{-\frac{2010012}{2010014}}$.", False),
    ("16386.17", r"She has \boxed{\$16,386.18}.", False),
    # numbers in a base
    ("204_5", r"The quotient is $\boxed{204_5}$.", True),
    ("204_5", r"The quotient is $\boxed{204_6}$.", False),
    # a whole completion that is one matrix
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{bmatrix}\n 1 & 2 \\\\\n 3 & 4\n\\end{bmatrix}", True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{bmatrix}\n 1 & 2 \\\\\n 3 & 5\n\\end{bmatrix}", False),
    # truncated or no answer
    ("12", r"So the answer is \boxed{1", False),
    ("12", "I could not solve it.", False),
]
