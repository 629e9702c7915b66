"""Skills: an agent's operating instructions as versioned Markdown (the Agent Skills specification).

A skill is a folder holding `SKILL.md` (YAML front matter: `name` equal to the folder's name,
`description`, optionally `license`, `compatibility`, `metadata`, `allowed-tools`; then a Markdown body)
and optionally `scripts/`, `references/`, `assets/`. Validation is the specification's reference library
(`skills-ref`), not a parser of ours.

Skills come from a source:
- a folder: one skill, or a folder of skill folders;
- a git repository at a revision: `REPO@REV` or `REPO@REV:SUBPATH`, REPO a local repository's path (or
  `owner/name` on GitHub, cloned once into sobrio's cache), REV a branch, tag or commit. It is read with
  dulwich at that revision, whatever the work tree holds, and `pin` turns a branch into its commit id, so
  a run can name, and later reproduce, the exact instructions it had.

Progressive disclosure, as the specification describes it: an agent's system prompt holds the skills'
names and descriptions only (`prompt_block`); a body enters the context when the agent calls `load_skill`,
a reference file when it calls `read_reference`.
"""

import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from sobrio.errors import SobrioError

_GIT_SOURCE = re.compile(r"(?P<repo>[^@]+)@(?P<rev>[^:@]+)(?::(?P<path>.*))?")
_GITHUB = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")


class SkillError(SobrioError):
    """A source that cannot be read, or skills that break the specification (each error names its file)."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message if not errors else message + ":\n  " + "\n  ".join(errors))
        self.errors = errors or []


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    folder: Path  # where its files are (a checkout of its revision for a git source)
    source: str  # the pinned source it came from (`REPO@COMMIT:PATH`, or the folder)
    revision: str | None  # the commit id, for a git source
    checkout: object = field(default=None, repr=False, compare=False)  # keeps a git checkout while in use

    def body(self) -> str:
        """The Markdown after the front matter: what `load_skill` puts in the context."""
        from skills_ref.parser import find_skill_md, parse_frontmatter

        return parse_frontmatter(find_skill_md(self.folder).read_text())[1]

    def references(self) -> list[str]:
        folder = self.folder / "references"
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []

    def read_reference(self, name: str) -> str:
        """One file of `references/` (a path that leaves that folder is refused)."""
        if name not in self.references():
            raise SkillError(f"skill {self.name!r} has no reference {name!r}; it has: "
                             f"{', '.join(self.references()) or 'none'}")
        return (self.folder / "references" / name).read_text()


class SkillSet:
    """The skills of one source, validated; a git source's checkout is removed with the set."""

    def __init__(self, skills: list[Skill], source: str, revision: str | None, checkout: Path | None = None):
        owner = _Checkout(checkout) if checkout is not None else None
        self.skills = {s.name: replace(s, checkout=owner) for s in skills}
        self.source, self.revision = source, revision

    def __getitem__(self, name: str) -> Skill:
        if name not in self.skills:
            raise SkillError(f"no skill {name!r} in {self.source}; there are: {', '.join(self.skills) or 'none'}")
        return self.skills[name]

    def __iter__(self):
        return iter(self.skills.values())

    def __len__(self) -> int:
        return len(self.skills)

    def prompt_block(self, names: list[str] | None = None) -> str:
        """Names and descriptions only (the specification's <available_skills> block), for a system prompt."""
        from skills_ref import to_prompt

        chosen = [self[n] for n in names] if names is not None else list(self)
        return to_prompt([s.folder for s in chosen])


class _Checkout:
    """A git source's files in a temporary folder, removed when no set or skill uses them any more."""

    def __init__(self, folder: Path):
        self.folder = folder
        weakref.finalize(self, shutil.rmtree, folder, True)


def load_skills(source: str) -> SkillSet:
    """Every skill of a source, validated by `skills-ref`; a SkillError lists each problem with its file."""
    git = _GIT_SOURCE.fullmatch(source)
    if git and not Path(source).exists():
        repo = _repository(git["repo"])
        commit = resolve_revision(repo, git["rev"])
        checkout = Path(tempfile.mkdtemp(prefix="sobrio-skills-"))
        try:
            root = _check_out(repo, commit, git["path"] or "", checkout)
            pinned = f"{git['repo']}@{commit}" + (f":{git['path']}" if git["path"] else "")
            skills = _validated(root, pinned, commit)
        except BaseException:
            shutil.rmtree(checkout, ignore_errors=True)
            raise
        return SkillSet(skills, pinned, commit, checkout)
    folder = Path(source)
    if not folder.is_dir():
        raise SkillError(f"skills source {source!r} is neither a folder nor REPO@REV[:PATH]")
    return SkillSet(_validated(folder, str(folder), None), str(folder), None)


def pin(source: str) -> str:
    """The source with its revision made a commit id (a folder stays as it is)."""
    return load_skills(source).source


def _validated(root: Path, source: str, revision: str | None) -> list[Skill]:
    from skills_ref import read_properties, validate

    folders = [root] if (root / "SKILL.md").is_file() or (root / "skill.md").is_file() else sorted(
        p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    errors = [f"{folder.name}/SKILL.md: {e}" for folder in folders for e in validate(folder)]
    if errors:
        raise SkillError(f"invalid skills in {source}", errors)
    skills = []
    for folder in folders:
        props = read_properties(folder)
        skills.append(Skill(props.name, props.description, folder, source, revision))
    return skills


# ---- git, through dulwich ----

def _repository(spec: str):
    """A local repository, or `owner/name` cloned once from GitHub into sobrio's cache."""
    from dulwich.repo import NotGitRepository, Repo

    path = Path(spec).expanduser()
    if not path.exists() and _GITHUB.fullmatch(spec):
        path = _github_clone(spec)
    try:
        return Repo(str(path))
    except NotGitRepository:
        raise SkillError(f"{spec!r} is not a git repository") from None


def _github_clone(spec: str) -> Path:
    from dulwich import porcelain

    from sobrio.paths import cache_dir

    target = cache_dir() / "skills" / spec.replace("/", "--")
    if not target.exists():
        try:
            porcelain.clone(f"https://github.com/{spec}.git", str(target), bare=True, errstream=None)
        except Exception as exc:  # noqa: BLE001 - network, auth, a missing repository: one clear error
            shutil.rmtree(target, ignore_errors=True)
            raise SkillError(f"could not clone github.com/{spec}: {type(exc).__name__}") from None
    return target


def resolve_revision(repo, rev: str) -> str:
    """A branch, tag or (abbreviated) commit id as the full commit id."""
    from dulwich.objectspec import parse_commit

    try:
        return parse_commit(repo, rev.encode()).id.decode()
    except (KeyError, ValueError):
        raise SkillError(f"no revision {rev!r} in {repo.path}") from None


def _check_out(repo, commit: str, subpath: str, into: Path) -> Path:
    """The files of `subpath` at `commit`, written under `into`; the folder they form."""
    tree = repo[repo[commit.encode()].tree]
    prefix = PurePosixPath(subpath.strip("/")) if subpath.strip("/") else None
    found = False
    for entry in repo.object_store.iter_tree_contents(tree.id):
        path = PurePosixPath(entry.path.decode())
        if prefix is not None and prefix not in path.parents:
            continue
        found = True
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(repo[entry.sha].data)
    if not found:
        raise SkillError(f"no path {subpath!r} in {repo.path} at {commit[:12]}")
    return into / prefix if prefix is not None else into
