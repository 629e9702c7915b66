"""`sobrio skills list | validate | show | pin SOURCE` (skills from a folder or a git repository at a
revision) and `sobrio agents run TEAM TASK` (a team of sub-agents on an OpenAI-compatible API)."""

import argparse
import asyncio
import json
import os
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


def add_agents_parser(sub) -> None:
    parser = sub.add_parser("agents", help="run a team of sub-agents (a team file) on sobrio's OpenAI API")
    actions = parser.add_subparsers(dest="action", required=True)
    run = actions.add_parser("run", help="plan, run the sub-agents concurrently, answer; print the answer")
    run.add_argument("team", help="the team file (TOML; see sobrio/agents/orchestrator.py)")
    run.add_argument("task", help="the task")
    run.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API (default: %(default)s, a "
                                                                           "local sobrio serve)")
    run.add_argument("--api-key", default=None, help="default: $SOBRIO_API_KEY, else none")
    run.add_argument("--trace", default=None, help="write the run's trace (agents, models, skills and their "
                                                   "revision, tool calls, tokens, time, energy) as JSON here; "
                                                   "nothing of the run is written otherwise")
    parser.set_defaults(func=cmd_agents)


def cmd_agents(args: argparse.Namespace) -> int:
    import openai

    from sobrio.agents.orchestrator import Orchestrator, Team

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or os.environ.get("SOBRIO_API_KEY")
                                or "none", max_retries=0)
    trace = asyncio.run(Orchestrator(Team.load(args.team), client).run(args.task))
    print(trace["answer"])
    totals = trace["totals"]
    print(f"{len(trace['agents'])} agent runs, {trace['seconds']:.1f}s, {totals['prompt_tokens']} prompt + "
          f"{totals['completion_tokens']} completion tokens, {totals['energy_j']:.1f} J", file=sys.stderr)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(trace, f, indent=1)
    return 0
