"""Sphinx configuration of the pyhook documentation (build: see docs/contributing.md)."""

from __future__ import annotations

import pyhook

project = "pyhook"
author = "the pyhook authors"
release = pyhook.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",  # prose pages in Markdown
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # "Args:" / "Returns:" sections in docstrings
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve

# The API reference documents what pyhook.__all__ exports under its public name (pyhook.Trace,
# not pyhook.trace.Trace); module pages add only what the top level does not export.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # no torch.nn.Module boilerplate (forward, extra_repr, train)
autosummary_generate = False
add_module_names = False
python_use_unqualified_type_names = True

html_theme = "furo"
html_title = f"pyhook {release}"
html_static_path: list[str] = []

_TOP_LEVEL = {id(getattr(pyhook, name)) for name in pyhook.__all__}


def _skip_reexported(app, what, name, obj, skip, options):
    """On a module page other than the top-level API, skip objects pyhook.__all__ documents."""
    if (
        what == "module"
        and app.env.docname != "api/pyhook"
        and callable(obj)
        and id(obj) in _TOP_LEVEL
    ):
        return True
    return None


def _list_public_names(app, docname, source):
    """Fill the summary table of api/pyhook from pyhook.__all__ (so it cannot drift)."""
    if docname == "api/pyhook":
        names = "\n   ".join(n for n in pyhook.__all__ if not n.startswith("__"))
        source[0] = source[0].replace("PYHOOK_ALL", names)


def _real_module_ids(app, doctree):
    """Give each object on the top-level API page an id under its defining module too.

    viewcode's source pages link an object to ``#<module>.<name>``, where ``<module>`` is the
    prefix its module was first documented under: ``pyhook.deephook`` for ``TraceMultiple``,
    whose description lives on the API page as ``pyhook.TraceMultiple``. The extra id makes
    those links land on it.
    """
    from sphinx import addnodes

    if app.env.docname != "api/pyhook":
        # A module some of whose objects pyhook.__all__ exports (pyhook.pipeline.steer:
        # mean_difference) is first seen by viewcode under the prefix ``pyhook`` when the
        # top-level page is read before its own page; its other objects are then linked as
        # ``#pyhook.<name>``. Give each object of a module page that id too (never a name the
        # top level exports, whose id is the API page's).
        if app.env.docname.startswith("api/"):
            for sig in doctree.findall(addnodes.desc_signature):
                fullname = sig.get("fullname")
                anchor = f"pyhook.{fullname}"
                if (
                    fullname
                    and sig.get("module") != "pyhook"
                    and fullname.split(".")[0] not in pyhook.__all__
                    and anchor not in sig["ids"]
                ):
                    sig["ids"].append(anchor)
        return

    for sig in doctree.findall(addnodes.desc_signature):
        module, fullname = sig.get("module"), sig.get("fullname")
        if not module or not fullname:
            continue
        real = getattr(getattr(pyhook, fullname.split(".")[0], None), "__module__", None)
        anchor = f"{real}.{fullname}"
        if isinstance(real, str) and real != module and anchor not in sig["ids"]:
            sig["ids"].append(anchor)


def setup(app):
    app.connect("doctree-read", _real_module_ids)
    app.connect("source-read", _list_public_names)
    app.connect("autodoc-skip-member", _skip_reexported)
