"""Write the shipped ToolQA-style prompt sets (chunk_llama/data/toolqa/*.jsonl).

    python scripts/make_prompt_sets.py

Four applications in the style of the paper's Table 2 workloads (ToolQA and
friends), written for this project: each has a system prompt of tool
definitions and rules, few-shot examples given as chat turns (a user question,
then the assistant's first tool call), and questions whose gold answer is the
first tool call that answers them. The system prompt and the few-shot turns are
the same for every question of an app: together they are its shared prefix.
The output is deterministic (seeded).
"""

from __future__ import annotations

import json
import os
import random

OUT = os.path.join(os.path.dirname(__file__), "..", "chunk_llama", "data", "toolqa")

CITIES = ["Boston", "Denver", "Seattle", "Austin", "Chicago", "Miami", "Phoenix", "Portland", "Atlanta", "Dallas",
          "Detroit", "Nashville", "Omaha", "Tucson", "Raleigh", "Madison", "Boise", "Tampa", "Memphis", "Reno"]
AIRPORTS = ["ATL", "LAX", "ORD", "DFW", "DEN", "JFK", "SFO", "SEA", "LAS", "MCO", "BOS", "MIA", "PHX", "IAH", "MSP",
            "DTW", "PHL", "CLT", "SLC", "BWI"]
CARRIERS = ["AA", "DL", "UA", "WN", "B6", "AS", "NK", "F9"]
CUISINES = ["ramen", "tacos", "pizza", "thai", "vegan", "bbq", "sushi", "bakery", "dim sum", "falafel"]
TOPICS = ["graph neural networks", "speech recognition", "protein folding", "image segmentation", "question answering",
          "reinforcement learning", "machine translation", "anomaly detection", "recommender systems", "code generation"]
AUTHORS = ["Mei Tanaka", "Lars Holm", "Ana Ruiz", "Kwame Mensah", "Priya Nair", "Tomas Novak", "Leila Haddad",
           "Oscar Lind", "Yuki Sato", "Ines Costa"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def date(rng):
    return f"2022-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


# Each app: intro, tools [(signature, description, example)], rules, question templates
# [(template, gold)], and how many few-shot examples (which sets the prompt length).
APPS = {
    "flights": dict(
        intro="You are FlightDesk, an assistant that answers questions about a database of US domestic flights in 2022 "
              "by calling tools. Every figure in your answer must come from a tool result.",
        tools=[
            ("FlightStatus[carrier flight_number, date]", "Returns the scheduled and actual departure and arrival times, "
             "delays in minutes, cancellation and diversion flags of one flight on one day. The carrier is its two-letter "
             "code and the date is YYYY-MM-DD.", "FlightStatus[DL 1182, 2022-03-14]"),
            ("FlightsBetween[origin, destination, date]", "Lists every flight from one airport to another on a day, with "
             "carrier, flight number and scheduled departure. Airports are three-letter codes.", "FlightsBetween[ATL, LAX, 2022-03-14]"),
            ("AirportDelays[airport, date]", "Returns the number of departures, cancellations and diversions and the mean "
             "departure delay at an airport on a day.", "AirportDelays[ORD, 2022-07-04]"),
            ("AirportInfo[airport]", "Returns the name, city, state, elevation in feet and coordinates of an airport.",
             "AirportInfo[DEN]"),
            ("CarrierOnTime[carrier, month]", "Returns the share of a carrier's flights that arrived within 15 minutes of "
             "schedule in a month written YYYY-MM.", "CarrierOnTime[WN, 2022-05]"),
            ("Calculate[expression]", "Evaluates arithmetic with + - * / ( ) and mean, median, min, max, sum, round.",
             "Calculate[round(mean([12, 0, 35]), 2)]"),
            ("Finish[answer]", "Ends the task with a short final answer.", "Finish[42]"),
        ],
        rules=["Use the fewest tool calls that answer the question.", "Use airport and carrier codes, never city or airline names.",
               "Dates are YYYY-MM-DD and months YYYY-MM.", "A cancelled flight has no delays; say so instead of guessing.",
               "Round averages to two decimals."],
        templates=[
            ("What was the departure delay of flight {c} {n} on {d}?", "FlightStatus[{c} {n}, {d}]"),
            ("Was flight {c} {n} cancelled on {d}?", "FlightStatus[{c} {n}, {d}]"),
            ("Which flights went from {a} to {b} on {d}?", "FlightsBetween[{a}, {b}, {d}]"),
            ("How many flights were cancelled at {a} on {d}?", "AirportDelays[{a}, {d}]"),
            ("What is the elevation of the {a} airport?", "AirportInfo[{a}]"),
            ("What share of {c} flights arrived on time in {m}?", "CarrierOnTime[{c}, {m}]"),
        ],
        num_examples=26,
    ),
    "weather": dict(
        intro="You are SkyCheck, an assistant that answers questions about past weather, forecasts and air quality "
              "in US cities by calling tools.",
        tools=[
            ("DailyWeather[city, date]", "Returns the minimum and maximum temperature in Fahrenheit, precipitation in "
             "inches and wind speed of a city on a past day.", "DailyWeather[Boston, 2022-01-29]"),
            ("Forecast[city, days]", "Returns the forecast for the next 1 to 10 days.", "Forecast[Denver, 3]"),
            ("ClimateNormal[city, month]", "Returns the 30-year average temperature and rainfall of a month (1-12).",
             "ClimateNormal[Miami, 8]"),
            ("AirQuality[city, date]", "Returns the air quality index and the main pollutant on a day.",
             "AirQuality[Phoenix, 2022-06-02]"),
            ("Finish[answer]", "Ends the task with a short final answer.", "Finish[71 F]"),
        ],
        rules=["Temperatures are in Fahrenheit.", "Call one tool per step."],
        templates=[
            ("How warm did it get in {city} on {d}?", "DailyWeather[{city}, {d}]"),
            ("Did it rain in {city} on {d}?", "DailyWeather[{city}, {d}]"),
            ("What is the weather forecast for {city} for the next {k} days?", "Forecast[{city}, {k}]"),
            ("What is the normal temperature in {city} in month {mo}?", "ClimateNormal[{city}, {mo}]"),
            ("How was the air quality in {city} on {d}?", "AirQuality[{city}, {d}]"),
        ],
        num_examples=10,
    ),
    "restaurants": dict(
        intro="You are TableScout, an assistant that answers questions about restaurants, cafes and bars from a "
              "business review database by calling tools.",
        tools=[
            ("SearchBusiness[category, city]", "Lists up to 20 businesses of a category in a city with their star "
             "rating and review count, best rated first.", "SearchBusiness[ramen, Seattle]"),
            ("BusinessInfo[name, city]", "Returns the address, price level (1-4), star rating, review count and "
             "attributes (parking, outdoor seating, wifi) of one business.", "BusinessInfo[Blue Door Cafe, Austin]"),
            ("OpenHours[name, city, weekday]", "Returns the opening hours of a business on a weekday.",
             "OpenHours[Blue Door Cafe, Austin, Sunday]"),
            ("Reviews[name, city, count]", "Returns the most recent reviews of a business with their stars.",
             "Reviews[Blue Door Cafe, Austin, 5]"),
            ("Finish[answer]", "Ends the task with a short final answer.", "Finish[4.5 stars]"),
        ],
        rules=["Business names are matched exactly; copy them from a search result.", "Weekdays are written in full.",
               "Call one tool per step."],
        templates=[
            ("Where can I get {q} in {city}?", "SearchBusiness[{q}, {city}]"),
            ("What is the best rated {q} place in {city}?", "SearchBusiness[{q}, {city}]"),
            ("Is {biz} in {city} open on {w}?", "OpenHours[{biz}, {city}, {w}]"),
            ("How expensive is {biz} in {city}?", "BusinessInfo[{biz}, {city}]"),
            ("What do people say about {biz} in {city}? Show {k} reviews.", "Reviews[{biz}, {city}, {k}]"),
        ],
        num_examples=14,
    ),
    "papers": dict(
        intro="You are PaperTrail, an assistant that answers questions about scientific papers, their authors, venues "
              "and citations from a bibliographic database by calling tools.",
        tools=[
            ("PaperSearch[keywords, year]", "Lists papers from a year whose title or abstract matches the keywords, "
             "with title, authors and venue.", "PaperSearch[graph neural networks, 2021]"),
            ("AuthorPapers[author]", "Lists the papers of an author, newest first.", "AuthorPapers[Mei Tanaka]"),
            ("Coauthors[author]", "Lists the coauthors of an author with the number of joint papers.",
             "Coauthors[Lars Holm]"),
            ("Citations[title]", "Returns how many times a paper is cited and its five most cited citing papers.",
             "Citations[Sparse Routing for Speech]"),
            ("Venue[title]", "Returns the venue and year of a paper.", "Venue[Sparse Routing for Speech]"),
            ("Finish[answer]", "Ends the task with a short final answer.", "Finish[ACL 2021]"),
        ],
        rules=["Copy titles exactly from a tool result.", "Author names are written First Last.", "Call one tool per step."],
        templates=[
            ("Which papers on {t} appeared in {y}?", "PaperSearch[{t}, {y}]"),
            ("What has {au} published?", "AuthorPapers[{au}]"),
            ("Who has {au} written papers with?", "Coauthors[{au}]"),
            ("How often is the paper '{title}' cited?", "Citations[{title}]"),
            ("Where was '{title}' published?", "Venue[{title}]"),
        ],
        num_examples=22,
    ),
}

BUSINESSES = ["Blue Door Cafe", "Golden Lantern", "Salt and Ember", "Little Fig", "Harbor Noodle", "Copper Kettle",
              "Green Sprout", "Night Owl Diner", "Saffron Table", "Pine Street Deli"]
TITLES = ["Sparse Routing for Speech", "Learning to Prune Graphs", "Contrastive Protein Embeddings",
          "Token Merging at Scale", "Robust Anomaly Scores", "Curriculum Policies for Robots", "Lightweight Segmenters",
          "Retrieval for Code Models", "Calibrated Recommenders", "Fast Beam Decoders"]


def fill(template: str, rng: random.Random) -> dict:
    values = dict(c=rng.choice(CARRIERS), n=rng.randint(100, 2999), d=date(rng), a=rng.choice(AIRPORTS),
                  m=f"2022-{rng.randint(1, 12):02d}", city=rng.choice(CITIES), k=rng.randint(2, 7),
                  mo=rng.randint(1, 12), q=rng.choice(CUISINES), biz=rng.choice(BUSINESSES), w=rng.choice(WEEKDAYS),
                  t=rng.choice(TOPICS), y=rng.randint(2015, 2024), au=rng.choice(AUTHORS), title=rng.choice(TITLES))
    values["b"] = rng.choice([a for a in AIRPORTS if a != values["a"]])
    return values


def system_prompt(name: str, app: dict) -> str:
    lines = [app["intro"], "", "You work in a loop of Thought, Action and Observation. In an Action you call exactly "
             "one tool in the format ToolName[arguments]. Your first Action must be the tool call that retrieves what "
             "the question asks; when you know the answer, call Finish[answer]. Answer in the format of the "
             "example turns: one Thought line, then one Action line.", "", "## Tools", ""]
    for i, (signature, description, example) in enumerate(app["tools"], 1):
        lines += [f"{i}. {signature}", f"   {description}", f"   Example: {example}", ""]
    lines += ["## Rules", ""] + [f"- {rule}" for rule in app["rules"]]
    return "\n".join(lines).strip() + "\n"


def few_shot(examples: list[tuple[str, str]]) -> list[dict]:
    """The worked examples as chat turns: the question, then the assistant's first step."""
    turns = []
    for question, action in examples:
        tool = action.split("[", 1)[0]
        answer = f"Thought: The {tool} tool answers this directly.\nAction: {action}"
        turns += [dict(role="user", content=question), dict(role="assistant", content=answer)]
    return turns


def round_robin_examples(app: dict, rng: random.Random, asked: set[str]) -> list[tuple[str, str]]:
    """`num_examples` worked examples covering the question templates evenly (each round
    of templates shuffled), none of them a question that is asked: a small model copies
    the tool of the examples, so every tool it should call must appear in them."""
    examples: list[tuple[str, str]] = []
    seen = set(asked)
    while len(examples) < app["num_examples"]:
        for template, gold in rng.sample(app["templates"], len(app["templates"])):
            values = fill(template, rng)
            question = template.format(**values)
            if question not in seen and len(examples) < app["num_examples"]:
                seen.add(question)
                examples.append((question, gold.format(**values)))
    return examples


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(2024)
    systems, questions = [], []
    for name, app in APPS.items():
        seen, pairs = set(), []
        while len(pairs) < app["num_examples"] + 60:
            template, gold = rng.choice(app["templates"])
            values = fill(template, rng)
            question = template.format(**values)
            if question not in seen:
                seen.add(question)
                pairs.append((question, gold.format(**values)))
        asked = pairs[app["num_examples"] :]  # as when the examples were drawn from `rng` too
        examples = round_robin_examples(app, random.Random(f"examples-{name}"), {q for q, _ in asked})
        systems.append(dict(app=name, system_prompt=system_prompt(name, app), few_shot=few_shot(examples)))
        questions += [dict(app=name, question=q, answer=a) for q, a in asked]
    rng.shuffle(questions)  # a mixed stream, as requests arrive; the eval groups them by app
    with open(os.path.join(OUT, "systems.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in systems)
    with open(os.path.join(OUT, "questions.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in questions)
    print(f"{len(systems)} applications, {len(questions)} questions in {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
