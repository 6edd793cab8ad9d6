// gpupool-idle: JupyterLab's warning before gpupool's idle culler stops this server, with "Keep it 1 h".
//
// It asks this server's own extension (gpupool.hub.lab_idle: GET gpupool/idle, POST gpupool/idle/keep), which asks
// the culler with the server's hub token: the browser needs no login of its own to the culler service. At start,
// then as often as the server's answer says (`check_every_s`: the culler's pass, 60 s by default, never under 5 s);
// one notification per warning, updated while it stands, gone when it no longer does.

import { Notification } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

// Until the server says otherwise (an answer without `check_every_s`, or no answer).
const CHECK_EVERY_MS = 60 * 1000;
const KEEP_HOURS = 1;

async function ask(settings, path, init = {}) {
  const url = URLExt.join(settings.baseUrl, path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  let body = {};
  try {
    body = await response.json();
  } catch (error) {
    // not JSON: the status says enough
  }
  return { status: response.status, body };
}

function timeOf(iso) {
  // The culler's messages say times in UTC (HH:MM): the same here.
  return iso ? `${iso.slice(11, 16)} UTC` : '';
}

const plugin = {
  id: 'gpupool-idle:plugin',
  description: "Warns before gpupool's idle culler stops this server, and keeps it on the user's word.",
  autoStart: true,
  activate: app => {
    const settings = app.serviceManager.serverSettings;
    // The notification on screen: its id, the stop it announces, its message.
    let shown = null;
    let checkEvery = CHECK_EVERY_MS;

    const forget = () => {
      if (shown) {
        Notification.dismiss(shown.id);
        shown = null;
      }
    };

    const keep = async () => {
      forget();
      try {
        const { status, body } = await ask(settings, 'gpupool/idle/keep', {
          method: 'POST',
          body: JSON.stringify({ hours: KEEP_HOURS })
        });
        if (status === 200) {
          Notification.success(
            `Kept: this server will not be stopped before ${timeOf(body.keep_until)}.`,
            { autoClose: 10000 }
          );
        } else {
          Notification.error(body.message || `The culler answered ${status}.`, { autoClose: false });
        }
      } catch (error) {
        Notification.error(`The culler could not be asked: ${error}`, { autoClose: false });
      }
    };

    const options = () => ({
      autoClose: false,
      actions: [{ label: `Keep it ${KEEP_HOURS} h`, callback: () => void keep(), displayType: 'accent' }]
    });

    // One check, then the next one after the interval the answer gives; none after a 503.
    const checkThenNext = async () => {
      if ((await check()) !== 'stop') {
        setTimeout(() => void checkThenNext(), checkEvery);
      }
    };

    const check = async () => {
      let answer;
      try {
        answer = await ask(settings, 'gpupool/idle');
      } catch (error) {
        return; // the server is away (stopping, restarting): the next check says more
      }
      if (answer.status === 503) {
        return 'stop'; // no culler to ask (a server gpupool did not start), nor will there be
      }
      if (answer.status !== 200) {
        return; // the culler did not answer: nothing to say until it does
      }
      const { warned, server, check_every_s: seconds } = answer.body;
      if (typeof seconds === 'number' && seconds > 0) {
        checkEvery = seconds * 1000;
      }
      if (!warned) {
        forget();
        return;
      }
      if (shown && shown.cullAt === server.cull_at) {
        // The same warning: its words may have moved on ("idle for 12 min"). Dismissed by the user: left so.
        if (shown.message !== server.message) {
          shown.message = server.message;
          Notification.update({ id: shown.id, message: server.message, type: 'warning', ...options() });
        }
        return;
      }
      forget();
      shown = {
        id: Notification.warning(server.message, options()),
        cullAt: server.cull_at,
        message: server.message
      };
    };

    void app.restored.then(() => void checkThenNext());
  }
};

export default plugin;
