"""What the site's own pages need that Jupyter Book 1 and its theme get wrong, so that a
reader's browser shows no error (tests/test_site.py opens every page and checks the console).

- sphinx-thebe registers its configuration script once per `env-before-read-docs`, and a
  Jupyter Book build emits that event twice: every page declared `const THEBE_JS_URL` twice,
  a SyntaxError. A page now lists each script once.
- pydata-sphinx-theme reads the light/dark mode from the browser's storage, falling back to
  `default_mode`; left empty, a first visit logs "Got invalid theme mode". It is set to
  "auto" (follow the reader's system), which is what the theme then resets to anyway.
"""

from __future__ import annotations


def _each_script_once(app, pagename, templatename, context, doctree) -> None:
    seen, kept = set(), []
    for script in context.get("script_files", []):
        # the same script registered twice: once with filename None, once '' (body-only scripts)
        key = (str(getattr(script, "filename", script) or ""),
               tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def _default_mode(app, pagename, templatename, context, doctree) -> None:
    context.setdefault("default_mode", "auto")
    if not context["default_mode"]:
        context["default_mode"] = "auto"


def setup(app):
    app.connect("html-page-context", _each_script_once, priority=900)
    app.connect("html-page-context", _default_mode)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
