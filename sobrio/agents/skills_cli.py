"""`sobrio skills list | validate | show | pin SOURCE`: skills from a folder or a git repository at a revision."""

import argparse
import sys


def add_skills_parser(sub) -> None:
    parser = sub.add_parser("skills", help="list, validate, show and pin Agent Skills (SKILL.md folders)")
    actions = parser.add_subparsers(dest="action", required=True)
    source_help = "a folder (one skill, or a folder of skills), or REPO@REV[:PATH] for a git repository"
    for name, text in (("list", "name, description and revision of each skill"),
                       ("validate", "check every skill against the specification (skills-ref); exit 1 if any "
                                    "fails, naming the file and the rule"),
                       ("pin", "the source with its revision as a commit id, to put in a team file")):
        actions.add_parser(name, help=text).add_argument("source", help=source_help)
    show = actions.add_parser("show", help="a skill's front matter fields and body, or one of its references")
    show.add_argument("source", help=source_help)
    show.add_argument("name", help="the skill's name")
    show.add_argument("--reference", default=None, help="a file under the skill's references/")
    parser.set_defaults(func=cmd_skills)


def cmd_skills(args: argparse.Namespace) -> int:
    from sobrio.agents.skills import SkillError, load_skills

    try:
        skills = load_skills(args.source)
    except SkillError as exc:
        if args.action != "validate":
            raise
        print(exc, file=sys.stderr)
        return 1
    if args.action == "validate":
        print(f"{len(skills)} skill(s) valid in {skills.source}")
    elif args.action == "pin":
        print(skills.source)
    elif args.action == "list":
        for skill in skills:
            print(f"{skill.name}\t{skill.description}\t{skill.revision or '(folder)'}")
    else:
        skill = skills[args.name]
        if args.reference is not None:
            print(skill.read_reference(args.reference))
        else:
            print(f"name: {skill.name}\ndescription: {skill.description}\nsource: {skill.source}\n"
                  f"references: {', '.join(skill.references()) or '-'}\n\n{skill.body()}")
    return 0
