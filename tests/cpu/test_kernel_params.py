"""Each kernel's parameters, as kernels.py lists them, against the device function in its header: the generated
entry point passes them by position, so the two lists must name the same parameters in the same order."""

from __future__ import annotations

import os
import re

import pytest

from tokenyard.backends.cuda import kernels
from tokenyard.jit.compiler import INCLUDE_DIR
from tokenyard.tools.bench import copy_limit


def _header(spec) -> str:
    with open(os.path.join(spec.include_root or INCLUDE_DIR, spec.header)) as f:
        return f.read()


def _macros() -> dict:
    """Every `#define NAME ...` (with continued lines) of the headers, by name."""
    found = {}
    for root, _, files in os.walk(INCLUDE_DIR):
        for name in files:
            text = open(os.path.join(root, name)).read().replace("\\\n", " ")
            for match in re.finditer(r"^#define (\w+)\s+(.*)$", text, re.MULTILINE):
                found[match.group(1)] = match.group(2)
    return found


def _split_top_level(text: str) -> list:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c in "(<[{"
        depth -= c in ")>]}"
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def device_parameter_names(spec) -> list:
    """The parameter names of `spec`'s device function, macros expanded."""
    function = spec.function.rsplit("::", 1)[-1]
    text = _header(spec)
    match = re.search(r"__device__ __forceinline__ void %s\(" % function, text)
    assert match, f"{spec.header} defines no device function {function}"
    depth, i = 1, match.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    macros, names = _macros(), []
    for param in _split_top_level(text[match.end():i - 1]):
        if param in macros:
            names += [re.findall(r"\w+", p)[-1] for p in _split_top_level(macros[param])]
        else:
            names.append(re.findall(r"\w+", param)[-1])
    return names


SPECS = {(s.header, s.function): s for s in (*kernels.every_kernel(), *copy_limit.every_kernel())}


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=lambda s: s.entry)
def test_every_kernels_parameter_list_names_its_device_functions_parameters_in_order(spec):
    assert device_parameter_names(spec) == [p.name for p in spec.params]


def test_a_swap_of_two_parameters_is_seen():
    spec = kernels.combine(4, 7168 * 2 // 16, 8)
    names = device_parameter_names(spec)
    swapped = [p.name for p in spec.params]
    i, j = swapped.index("num_tokens"), swapped.index("num_send_blocks")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert names != swapped
