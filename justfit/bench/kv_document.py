"""A held-out long document for KV quality rows: prose and code written for this bench, never tuned on."""

DOCUMENT = '''# Field notes from the Harbourside tide-gauge project

The tide gauge at the end of the old ferry pier was installed in the spring, after two winters of arguing
about who would pay for it. It is a plain steel tube bolted to a pile, with a pressure sensor at the bottom,
a small solar panel on top, and a radio that wakes up every six minutes to send a single line of numbers
to the harbour office. Nobody expected it to be interesting. Within a month it had become the most
discussed object in town, mostly because it disagreed with the printed tide tables by as much as thirty
centimetres on windy days, and the fishermen wanted to know which of the two was lying.

Neither was lying, of course. The printed tables predict the astronomical tide: the regular rise and fall
driven by the moon and the sun, computed from a few dozen harmonic constituents with names like M2, S2,
K1 and O1. The gauge measures what the water actually does, which is the astronomical tide plus
everything the weather adds on top. A steady south-westerly pushes water into the bay and holds it
there; a deep low-pressure system lifts the sea surface by about a centimetre for every hectopascal the
pressure drops. On a stormy night in October the two effects together raised high water by forty-one
centimetres above the prediction, and the lower car park flooded for the first time in eleven years.

The interesting part of the project has been separating those two signals. The method we settled on is
simple enough to explain at the harbour meeting. First, fit the harmonic constituents to a long record of
calm days, so that the model captures the tide and nothing else. Second, subtract the model from every
reading to get the residual, which is the weather's contribution plus sensor noise. Third, look at the
residual next to the wind and pressure records from the airport, and check that the big excursions line
up with storms. They did, with one embarrassing exception: a sharp spike every Tuesday morning that
turned out to be the dredging barge mooring against the pile and shaking the tube.

## The processing script

The harbour office runs a short Python script once an hour. It reads the raw readings, removes obvious
glitches, fits the tide model once a week, and writes the residual to a file the website plots. The core
of it is below; the real script also handles the radio's habit of repeating a line when it loses its
acknowledgement, which is why readings are de-duplicated by timestamp before anything else happens.

```python
import math
from dataclasses import dataclass

CONSTITUENTS = {"M2": 12.4206012, "S2": 12.0, "N2": 12.65834751, "K1": 23.93447213, "O1": 25.81933871}


@dataclass
class Reading:
    minutes: float  # minutes since the start of the record
    level_cm: float


def dedupe(readings):
    """Keep the first reading of each timestamp; the radio repeats lines it thinks were lost."""
    seen, out = set(), []
    for r in readings:
        if r.minutes not in seen:
            seen.add(r.minutes)
            out.append(r)
    return out


def despike(readings, limit_cm=25.0):
    """Drop readings that jump more than limit_cm from both neighbours (the barge, mostly)."""
    keep = [readings[0]]
    for prev, cur, nxt in zip(readings, readings[1:], readings[2:]):
        if abs(cur.level_cm - prev.level_cm) > limit_cm and abs(cur.level_cm - nxt.level_cm) > limit_cm:
            continue
        keep.append(cur)
    keep.append(readings[-1])
    return keep


def design_row(minutes):
    row = [1.0]
    for period_h in CONSTITUENTS.values():
        w = 2 * math.pi * minutes / (60.0 * period_h)
        row += [math.cos(w), math.sin(w)]
    return row


def fit(readings):
    """Least squares for the mean level and a cosine/sine pair per constituent."""
    import numpy as np

    a = np.array([design_row(r.minutes) for r in readings])
    b = np.array([r.level_cm for r in readings])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    return coef


def residuals(readings, coef):
    out = []
    for r in readings:
        predicted = sum(c * x for c, x in zip(coef, design_row(r.minutes)))
        out.append((r.minutes, r.level_cm - predicted))
    return out
```

Two details in that script caused more trouble than the mathematics. The first is time. The gauge's clock
drifts by a few seconds a day and is corrected by the radio whenever it hears the office, so timestamps
occasionally step backwards. Sorting by timestamp before de-duplicating fixed the worst of it, but the
weekly fit still has to tolerate small gaps and overlaps. The second is the despiking threshold. Set it too
low and a genuine storm surge, which can rise fifteen centimetres in a single six-minute interval, gets
thrown away as a glitch; set it too high and the barge gets through. Twenty-five centimetres, compared
against both neighbours rather than one, was the compromise that survived a winter of storms.

## What the numbers say after one year

After twelve months the fitted constituents agree with the published ones to within a few millimetres for
M2 and S2, which is reassuring, and to within two centimetres for the diurnal K1 and O1, which is about
what one year of data can resolve. The residual has a standard deviation of nine centimetres in summer and
nineteen in winter. Its largest positive value, the October storm, was forty-one centimetres; its largest
negative value, minus twenty-eight, came during a long spell of easterly wind in February that emptied the
bay enough to ground two moored yachts at low water.

The practical result is a small addition to the harbour website: next to the printed prediction there is
now a second line, the prediction plus the current residual, extrapolated forward with a simple decay.
It is wrong in the way every forecast is wrong, but it is wrong by less than the printed table on exactly
the days when people care, and the fishermen have stopped asking which of the two is lying. They now ask
why the line cannot see tomorrow's storm, which is a better question, and one the weather service answers.

## Things we would do differently

We would put the sensor in a stilling well, a wider pipe with a small opening at the bottom that damps
waves before they reach the sensor; the bare tube records every passing wake as noise. We would log the
battery voltage with every reading, because the only two gaps in the record both started with a cold
night and a flat battery, and we found out days later. And we would write the processing script with
tests from the first day. The version above is the fourth rewrite; the third one silently swapped the
sine and cosine columns for S2 and nobody noticed for a month, because the residual still looked like
weather.

```python
def test_fit_recovers_a_known_tide():
    truth = {"mean": 210.0, "M2": (80.0, 0.4), "K1": (12.0, 1.1)}
    readings = []
    for k in range(24 * 10 * 60 // 6):
        minutes = 6.0 * k
        level = truth["mean"]
        for name in ("M2", "K1"):
            amp, phase = truth[name]
            w = 2 * math.pi * minutes / (60.0 * CONSTITUENTS[name])
            level += amp * math.cos(w - phase)
        readings.append(Reading(minutes, level))
    coef = fit(readings)
    assert abs(coef[0] - truth["mean"]) < 0.5
    m2 = math.hypot(coef[1], coef[2])
    assert abs(m2 - 80.0) < 1.0
```

The test takes a fraction of a second and would have caught the swapped columns on the first run. The
harbour master, who does not read Python, asked what it checks, and the answer turned out to be the best
summary of the whole project: we invent a tide whose answer we already know, feed it to the program, and
make sure the program finds it again. Everything else is the weather.
'''
