#!/usr/bin/env python3
"""The crate's public API as a sorted listing, one item per line, from rustdoc's JSON.

    python3 scripts/public_api.py            # compare with docs/public-api.txt (exit 1 on a difference)
    python3 scripts/public_api.py --bless    # write docs/public-api.txt

It builds the JSON with `cargo rustdoc --output-format json` (an unstable rustdoc option, enabled
on the stable toolchain through RUSTC_BOOTSTRAP=1, for the crate's rustdoc only), walks the crate
from its root through every public module and re-export, and prints each reachable item with its
path as a user names it: structs, enums and their variants, public fields, traits and their
items, functions and methods with their signatures, constants, type aliases, and the trait
implementations of each type (auto traits such as `Send` and `Sync` included, on one line per
type, blanket implementations left out). Any change to the surface then shows as a diff in review.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "docs" / "public-api.txt"
CRATE = "tower_lock"


def build_json():
    """rustdoc's JSON of the crate, built in the suite's own target directory: only the crate's
    rustdoc runs with RUSTC_BOOTSTRAP=1 (through a RUSTDOC wrapper), so the dependencies'
    metadata that clippy and `cargo doc` built is reused rather than built again."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    target.mkdir(parents=True, exist_ok=True)
    wrapper = target / "rustdoc-bootstrap.sh"
    rustdoc = os.environ.get("RUSTDOC", "rustdoc")
    wrapper.write_text(f'#!/bin/sh\nRUSTC_BOOTSTRAP=1 exec "{rustdoc}" "$@"\n')
    wrapper.chmod(0o755)
    subprocess.run(
        [
            "cargo", "rustdoc", "-q", "--lib", "-p", "tower-lock", "--all-features",
            "--", "-Z", "unstable-options", "--output-format", "json",
        ],
        cwd=ROOT, env=dict(os.environ, RUSTDOC=str(wrapper)), check=True,
    )
    return json.loads((target / "doc" / f"{CRATE}.json").read_text())


class Render:
    def __init__(self, doc):
        self.doc = doc
        self.index = doc["index"]
        self.paths = doc["paths"]

    def item(self, id_):
        return self.index.get(str(id_))

    # ---- types ----------------------------------------------------------------------------

    def path_name(self, p):
        name = p.get("path") or p.get("name")
        if not name:
            summary = self.paths.get(str(p.get("id")))
            name = summary["path"][-1] if summary else "?"
        args = p.get("args")
        return name + (self.args(args) if args else "")

    def args(self, a):
        if "angle_bracketed" in a:
            ab = a["angle_bracketed"]
            parts = []
            for arg in ab.get("args", []):
                if "type" in arg:
                    parts.append(self.ty(arg["type"]))
                elif "lifetime" in arg:
                    parts.append(arg["lifetime"])
                elif "const" in arg:
                    parts.append(str(arg["const"].get("expr", "_")))
                else:
                    parts.append("_")
            for c in ab.get("constraints", []):
                b = c.get("binding", {})
                head = c["name"] + (self.args(c["args"]) if c.get("args") else "")
                if "equality" in b:
                    eq = b["equality"]
                    parts.append(f"{head} = {self.ty(eq['type']) if 'type' in eq else eq}")
                elif "constraint" in b:
                    parts.append(f"{head}: {self.bounds(b['constraint'])}")
            return f"<{', '.join(parts)}>" if parts else ""
        if "parenthesized" in a:
            p = a["parenthesized"]
            out = f"({', '.join(self.ty(t) for t in p.get('inputs', []))})"
            if p.get("output"):
                out += f" -> {self.ty(p['output'])}"
            return out
        return ""

    def bounds(self, bs):
        out = []
        for b in bs:
            if "trait_bound" in b:
                tb = b["trait_bound"]
                hrtb = self.hrtb(tb.get("generic_params", []))
                q = "?" if tb.get("modifier") == "maybe" else ""
                out.append(f"{hrtb}{q}{self.path_name(tb['trait'])}")
            elif "outlives" in b:
                out.append(b["outlives"])
            elif "use" in b:
                out.append("use<..>")
        return " + ".join(out)

    def hrtb(self, params):
        names = [p["name"] for p in params]
        return f"for<{', '.join(names)}> " if names else ""

    def ty(self, t):
        if t is None:
            return "()"
        if "resolved_path" in t:
            return self.path_name(t["resolved_path"])
        if "generic" in t:
            return t["generic"]
        if "primitive" in t:
            return t["primitive"]
        if "borrowed_ref" in t:
            r = t["borrowed_ref"]
            lt = f"{r['lifetime']} " if r.get("lifetime") else ""
            m = "mut " if r.get("is_mutable") else ""
            return f"&{lt}{m}{self.ty(r['type'])}"
        if "tuple" in t:
            items = [self.ty(x) for x in t["tuple"]]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if "slice" in t:
            return f"[{self.ty(t['slice'])}]"
        if "array" in t:
            return f"[{self.ty(t['array']['type'])}; {t['array']['len']}]"
        if "impl_trait" in t:
            return f"impl {self.bounds(t['impl_trait'])}"
        if "dyn_trait" in t:
            d = t["dyn_trait"]
            parts = [self.hrtb(x.get("generic_params", [])) + self.path_name(x["trait"]) for x in d["traits"]]
            if d.get("lifetime"):
                parts.append(d["lifetime"])
            return f"dyn {' + '.join(parts)}"
        if "qualified_path" in t:
            q = t["qualified_path"]
            self_ty = self.ty(q["self_type"])
            name = q["name"] + (self.args(q["args"]) if q.get("args") else "")
            if q.get("trait"):
                return f"<{self_ty} as {self.path_name(q['trait'])}>::{name}"
            return f"{self_ty}::{name}"
        if "raw_pointer" in t:
            r = t["raw_pointer"]
            return f"*{'mut' if r.get('is_mutable') else 'const'} {self.ty(r['type'])}"
        if "function_pointer" in t:
            f = t["function_pointer"]
            return f"fn({', '.join(self.ty(x[1]) for x in f['sig']['inputs'])}) -> {self.ty(f['sig'].get('output'))}"
        if t == "infer" or "infer" in t:
            return "_"
        return json.dumps(t)

    def generics(self, g):
        params = []
        for p in (g or {}).get("params", []):
            kind = p["kind"]
            if "lifetime" in kind:
                params.append(p["name"])
            elif "type" in kind:
                if kind["type"].get("is_synthetic"):
                    continue
                b = self.bounds(kind["type"].get("bounds", []))
                d = kind["type"].get("default")
                params.append(p["name"] + (f": {b}" if b else "") + (f" = {self.ty(d)}" if d else ""))
            elif "const" in kind:
                params.append(f"const {p['name']}: {self.ty(kind['const']['type'])}")
        return f"<{', '.join(params)}>" if params else ""

    def where(self, g):
        preds = []
        for w in (g or {}).get("where_predicates", []):
            if "bound_predicate" in w:
                b = w["bound_predicate"]
                preds.append(f"{self.hrtb(b.get('generic_params', []))}{self.ty(b['type'])}: {self.bounds(b['bounds'])}")
            elif "lifetime_predicate" in w:
                lp = w["lifetime_predicate"]
                preds.append(f"{lp['lifetime']}: {' + '.join(lp['outlives'])}")
            elif "eq_predicate" in w:
                e = w["eq_predicate"]
                preds.append(f"{self.ty(e['lhs'])} = {self.ty(e['rhs'].get('type'))}")
        return f" where {', '.join(preds)}" if preds else ""

    def fn(self, name, f):
        h = f.get("header", {})
        q = "".join(
            word for flag, word in (("is_const", "const "), ("is_async", "async "), ("is_unsafe", "unsafe "))
            if h.get(flag)
        )
        ins = []
        for arg, t in f["sig"]["inputs"]:
            if arg == "self":
                rendered = self.ty(t)
                ins.append({"Self": "self", "&Self": "&self", "&mut Self": "&mut self"}.get(rendered, f"self: {rendered}"))
            else:
                ins.append(f"{arg}: {self.ty(t)}")
        out = f.get("sig", {}).get("output")
        ret = f" -> {self.ty(out)}" if out is not None else ""
        return f"{q}fn {name}{self.generics(f['generics'])}({', '.join(ins)}){ret}{self.where(f['generics'])}"


def listing(doc):
    r = Render(doc)
    lines = set()
    seen = set()
    auto = {}

    def is_local(id_):
        it = r.item(id_)
        return it is not None and it.get("crate_id") == 0

    def public(it):
        return it.get("visibility") == "public"

    def impl_lines(owner, impls):
        for iid in impls:
            imp = r.item(iid)
            if imp is None:
                continue
            i = imp["inner"]["impl"]
            if i.get("blanket_impl") is not None:
                continue
            trait = i.get("trait")
            if trait is None:
                for mid in i["items"]:
                    m = r.item(mid)
                    if m is None or not public(m):
                        continue
                    member(owner, m)
                continue
            neg = "!" if i.get("is_negative") else ""
            unsafe = "unsafe " if i.get("is_unsafe") else ""
            for_ = i["for"]
            if "resolved_path" in for_:
                args = for_["resolved_path"].get("args")
                for_ = owner + (r.args(args) if args else "")
            else:
                for_ = r.ty(for_)
            generics, where = r.generics(i["generics"]), r.where(i["generics"])
            if i.get("is_synthetic"):
                # Auto traits (Send, Sync, Unpin, ...): one line per type and set of bounds.
                auto.setdefault((generics, for_, where), []).append(f"{neg}{r.path_name(trait)}")
                continue
            lines.add(f"{unsafe}impl{generics} {neg}{r.path_name(trait)} for {for_}{where}")

    def member(owner, m):
        inner = m["inner"]
        name = m["name"]
        if "function" in inner:
            lines.add(f"pub {r.fn(f'{owner}::{name}', inner['function'])}")
        elif "assoc_const" in inner:
            lines.add(f"pub const {owner}::{name}: {r.ty(inner['assoc_const']['type'])}")
        elif "assoc_type" in inner:
            at = inner["assoc_type"]
            b = r.bounds(at.get("bounds", []))
            lines.add(f"type {owner}::{name}{r.generics(at.get('generics'))}{': ' + b if b else ''}"
                      + (f" = {r.ty(at['type'])}" if at.get("type") else ""))

    def visit(id_, path):
        it = r.item(id_)
        if it is None:
            lines.add(f"pub use {path} (external)")
            return
        key = (str(id_), path)
        if key in seen:
            return
        seen.add(key)
        inner = it["inner"]
        kind = next(iter(inner))
        body = inner[kind]
        if kind == "module":
            lines.add(f"pub mod {path}")
            for cid in body["items"]:
                c = r.item(cid)
                if c is None or not public(c):
                    continue
                if "use" in c["inner"]:
                    u = c["inner"]["use"]
                    if u.get("is_glob"):
                        target = r.item(u["id"]) if u.get("id") is not None else None
                        if target and "module" in target["inner"]:
                            for gid in target["inner"]["module"]["items"]:
                                g = r.item(gid)
                                if g is not None and public(g) and g.get("name"):
                                    visit(gid, f"{path}::{g['name']}")
                        continue
                    if u.get("id") is None or not is_local(u["id"]):
                        lines.add(f"pub use {path}::{u['name']} = {u['source']}")
                        continue
                    visit(u["id"], f"{path}::{u['name']}")
                elif c.get("name"):
                    visit(cid, f"{path}::{c['name']}")
        elif kind == "struct":
            g = body["generics"]
            k = body["kind"]
            if k == "unit":
                shape = ";"
            elif "tuple" in k:
                fields = []
                for fid in k["tuple"]:
                    f = r.item(fid) if fid is not None else None
                    fields.append(f"pub {r.ty(f['inner']['struct_field'])}" if f and public(f) else "_")
                shape = f"({', '.join(fields)});"
            else:
                shape = ""
                for fid in k["plain"]["fields"]:
                    f = r.item(fid)
                    if f and public(f):
                        lines.add(f"pub {path}::{f['name']}: {r.ty(f['inner']['struct_field'])}")
                if k["plain"].get("has_stripped_fields"):
                    shape = " { .. }"
            attrs = "#[non_exhaustive] " if any("non_exhaustive" in str(a) for a in it.get("attrs", [])) else ""
            lines.add(f"{attrs}pub struct {path}{r.generics(g)}{r.where(g)}{shape}")
            impl_lines(path, body["impls"])
        elif kind == "enum":
            g = body["generics"]
            attrs = "#[non_exhaustive] " if any("non_exhaustive" in str(a) for a in it.get("attrs", [])) else ""
            lines.add(f"{attrs}pub enum {path}{r.generics(g)}{r.where(g)}")
            for vid in body["variants"]:
                v = r.item(vid)
                vk = v["inner"]["variant"]["kind"]
                if vk == "plain":
                    lines.add(f"pub {path}::{v['name']}")
                elif "tuple" in vk:
                    fs = [r.ty(r.item(f)["inner"]["struct_field"]) if f is not None else "_" for f in vk["tuple"]]
                    lines.add(f"pub {path}::{v['name']}({', '.join(fs)})")
                else:
                    fs = [f"{r.item(f)['name']}: {r.ty(r.item(f)['inner']['struct_field'])}" for f in vk["struct"]["fields"]]
                    more = ", .." if vk["struct"].get("has_stripped_fields") else ""
                    lines.add(f"pub {path}::{v['name']} {{ {', '.join(fs)}{more} }}")
            impl_lines(path, body["impls"])
        elif kind == "trait":
            g = body["generics"]
            b = r.bounds(body.get("bounds", []))
            unsafe = "unsafe " if body.get("is_unsafe") else ""
            lines.add(f"pub {unsafe}trait {path}{r.generics(g)}{': ' + b if b else ''}{r.where(g)}")
            for mid in body["items"]:
                m = r.item(mid)
                if m is not None:
                    member(path, m)
            for iid in body.get("implementations", []):
                imp = r.item(iid)
                if imp is None or not is_local(iid):
                    continue
                i = imp["inner"]["impl"]
                for_ = i["for"]
                # A local type lists its own impls (under its public path): listed once, there.
                if "resolved_path" in for_ and is_local(for_["resolved_path"]["id"]):
                    continue
                if i.get("blanket_impl") is None:
                    lines.add(f"impl{r.generics(i['generics'])} {r.path_name(i['trait'])} for {r.ty(i['for'])}{r.where(i['generics'])}")
        elif kind == "function":
            lines.add(f"pub {r.fn(path, body)}")
        elif kind == "constant":
            lines.add(f"pub const {path}: {r.ty(body['type'])}")
        elif kind == "static":
            lines.add(f"pub static {path}: {r.ty(body['type'])}")
        elif kind == "type_alias":
            lines.add(f"pub type {path}{r.generics(body['generics'])} = {r.ty(body['type'])}")
        elif kind == "macro":
            lines.add(f"pub macro {path}!")
        else:
            lines.add(f"pub {kind} {path}")

    visit(doc["root"], CRATE)
    for (generics, for_, where), traits in auto.items():
        lines.add(f"impl{generics} {' + '.join(sorted(traits))} for {for_}{where}")
    return sorted(lines)


def main():
    bless = "--bless" in sys.argv[1:]
    text = "\n".join(listing(build_json())) + "\n"
    if bless:
        SNAPSHOT.write_text(text)
        print(f"wrote {SNAPSHOT.relative_to(ROOT)}: {text.count(chr(10))} lines")
        return 0
    old = SNAPSHOT.read_text() if SNAPSHOT.exists() else ""
    if old == text:
        print(f"public API unchanged ({text.count(chr(10))} lines in {SNAPSHOT.relative_to(ROOT)})")
        return 0
    import difflib
    sys.stdout.writelines(
        difflib.unified_diff(old.splitlines(True), text.splitlines(True), "docs/public-api.txt", "the code")
    )
    print(
        "\nerror: the public API differs from docs/public-api.txt. If the change is deliberate, run\n"
        "  python3 scripts/public_api.py --bless\nand commit the new listing (and say it in CHANGELOG.md).",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
