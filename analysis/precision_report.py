"""The precision plans' section of report.html: what report.md shows of them, as HTML.

    html = into_html(HTML.render(...), runs)    # analysis/report.py, before "How every number ..."

plan_check's verdicts (the plan arm and the uniform arm of each recipe against BF16), each plan's
module table (the recipe every block module ran under `stability=plan`, BF16 cells in bold), and the
ranking of the runs' counterfactual rows per candidate (analysis.precision_ranking.report_parts,
the same tables as report.md and precision_ranking.csv). Nothing is added for runs without them.
"""

from __future__ import annotations

import jinja2

from analysis import keys as K
from analysis.precision_ranking import RANKING_NOTE, SECTION_TITLES, report_parts

ANCHOR = "<h2>How every number was obtained</h2>"
"""Where the section goes in report.html: after the groups, before the method notes."""

SECTION = jinja2.Template(
    """{% if verdicts %}<h2 id=plan-check>{{ titles.verdicts }}</h2>
<ul>{% for v in verdicts %}<li>{{ v }}</li>{% endfor %}</ul>
{% endif %}{% if plans is not none %}<h2 id=plans>{{ titles.plans }}</h2>
<table><tr>{% for h in plans.columns %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in plans.itertuples(index=False) %}<tr>{% for c in row %}
<td{% if c == baseline %} style="font-weight:600"{% endif %}>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% endif %}{% if ranking %}<h2 id=ranking>{{ titles.ranking }}</h2>
<p class=small>{{ note }}</p>
{% for cand, table in ranking %}<h3>{{ cand }}</h3>
<table><tr>{% for h in table.columns %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in table.itertuples(index=False) %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% endfor %}{% endif %}""",
    autoescape=True,
)


def html_section(runs) -> str:
    """The section's HTML (escaped), empty where the runs have no plan_check verdict, no plan run and
    no counterfactual rows."""
    verdicts, plans, ranking = report_parts(runs)
    if not verdicts and not len(plans) and not ranking:
        return ""
    return SECTION.render(
        verdicts=verdicts, plans=plans if len(plans) else None, ranking=ranking, note=RANKING_NOTE,
        titles=SECTION_TITLES, baseline=K.BASELINE_RECIPE,
    )  # fmt: skip


def into_html(html: str, runs) -> str:
    """report.html with the section before its method notes (at the end of the body if it has none)."""
    section = html_section(runs)
    if not section:
        return html
    at = html.find(ANCHOR)
    at = at if at >= 0 else html.rfind("</body>")
    return html[:at] + section + "\n" + html[at:]
